"""Render ``k8s/`` into the manifests to apply, with ``serveConfigV2`` from a ``configs/*.yaml`` file.

    python -m deploy.render --overlay gpu-efa --config configs/gpu-p5en-qwen3-32b-push.yaml

``k8s/`` is a kustomize tree (a base and overlays). This module builds it with the part of
kustomize the tree uses, with kustomize's semantics; ``tests/unit/deploy/test_render.py`` compares the
result with ``kubectl kustomize``:

* ``resources``: YAML files (any number of documents) or directories with a kustomization.yaml,
  built first, in order.
* ``components``: directories whose kustomization.yaml is ``kind: Component``, applied next, in
  order: each adds its own resources, then runs its patches and images over everything so far.
* ``patches``: each a ``path`` and an optional ``target`` (group, version, kind, name). A file
  holding a mapping is a merge patch on the resource named by its own apiVersion, kind and
  metadata.name: mappings merge key by key, null deletes a key, anything else (lists included)
  replaces. That is what kustomize does for custom resources such as RayService, whose lists carry
  no merge keys. A file holding a list is a JSON 6902 patch (add, remove, replace, test) on
  ``target``.
* ``images``: ``name`` to ``newName`` / ``newTag`` / ``digest`` on every container image, after the
  patches.

A Component cannot be built on its own or listed as a resource, nor a Kustomization as a component
(kustomize refuses both).

Any other kustomization key is refused by name. The serve config goes into the one RayService as
a YAML string, then ``deploy.checks`` compares config and manifests; the command refuses to print
manifests that do not fit their config.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
K8S_DIR = REPO / "k8s"
KUSTOMIZATION = "kustomization.yaml"
SUPPORTED_KEYS = ("apiVersion", "kind", "resources", "components", "patches", "images")
COMPONENT = "Component"
SERVE_CONFIG_PLACEHOLDER = "__RENDERED_BY_deploy/render.py__"

Manifest = dict[str, Any]


class RenderError(ValueError):
    """The tree, a patch or the config cannot be rendered; the message says where."""


# --------------------------------------------------------------------------- the kustomize subset


def build(directory: Path) -> list[Manifest]:
    """The manifests of the kustomization in ``directory`` (no serve config yet)."""
    return _accumulate([], directory, component=False)


def _kustomization(directory: Path, component: bool) -> dict[str, Any]:
    kustomization_file = directory / KUSTOMIZATION
    if not kustomization_file.is_file():
        raise RenderError(f"{directory}: no {KUSTOMIZATION}")
    kustomization = yaml.safe_load(kustomization_file.read_text()) or {}
    unknown = sorted(set(kustomization) - set(SUPPORTED_KEYS))
    if unknown:
        raise RenderError(
            f"{kustomization_file}: unsupported key(s) {', '.join(unknown)}; deploy.render handles "
            f"{', '.join(SUPPORTED_KEYS)}"
        )
    if (kustomization.get("kind") == COMPONENT) != component:
        wanted = "a Component (components:)" if component else "a Kustomization (resources:, or built directly)"
        raise RenderError(f"{kustomization_file}: kind {kustomization.get('kind', 'Kustomization')!r}, but used as {wanted}")
    return kustomization


def _accumulate(manifests: list[Manifest], directory: Path, component: bool) -> list[Manifest]:
    """kustomize's order: resources, then components (each over all so far), then patches and images."""
    kustomization = _kustomization(directory, component)
    manifests = list(manifests)
    for entry in kustomization.get("resources", []):
        path = directory / entry
        manifests += build(path) if path.is_dir() else _load_documents(path)
    for entry in kustomization.get("components", []):
        manifests = _accumulate(manifests, directory / entry, component=True)
    for patch in kustomization.get("patches", []):
        manifests = _apply_patch(manifests, directory, patch)
    for image in kustomization.get("images", []):
        manifests = [_set_image(m, image) for m in manifests]
    return manifests


def _load_documents(path: Path) -> list[Manifest]:
    if not path.is_file():
        raise RenderError(f"{path}: no such file")
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _identity(manifest: Manifest) -> tuple[str, str, str]:
    return manifest.get("apiVersion", ""), manifest.get("kind", ""), manifest.get("metadata", {}).get("name", "")


def _matches(manifest: Manifest, target: dict[str, str]) -> bool:
    api_version, kind, name = _identity(manifest)
    group, _, version = api_version.rpartition("/")
    wanted = {"group": group, "version": version, "kind": kind, "name": name}
    unknown = sorted(set(target) - set(wanted))
    if unknown:
        raise RenderError(f"patch target: unsupported key(s) {', '.join(unknown)}; use {', '.join(wanted)}")
    return all(wanted[key] == value for key, value in target.items())


def _apply_patch(manifests: list[Manifest], directory: Path, patch: dict[str, Any]) -> list[Manifest]:
    if set(patch) - {"path", "target"} or "path" not in patch:
        raise RenderError(f"{directory / KUSTOMIZATION}: a patch needs `path` and may have `target`, got {sorted(patch)}")
    path = directory / patch["path"]
    if not path.is_file():
        raise RenderError(f"{path}: no such file")
    body = yaml.safe_load(path.read_text())
    if isinstance(body, dict):
        api_version, kind, name = _identity(body)
        group, _, version = api_version.rpartition("/")
        target = {"group": group, "version": version, "kind": kind, "name": name}
        apply = lambda m: merge_patch(m, body)  # noqa: E731
    elif isinstance(body, list):
        if "target" not in patch:
            raise RenderError(f"{path}: a JSON 6902 patch needs a `target`")
        target = patch["target"]
        apply = lambda m: json_patch(m, body, where=str(path))  # noqa: E731
    else:
        raise RenderError(f"{path}: a patch file holds a mapping (merge patch) or a list (JSON 6902)")
    hits = [i for i, m in enumerate(manifests) if _matches(m, target)]
    if len(hits) != 1:
        raise RenderError(f"{path}: target {target} matches {len(hits)} resources, not 1")
    out = list(manifests)
    out[hits[0]] = apply(manifests[hits[0]])
    return out


def merge_patch(target: Any, patch: Any) -> Any:
    """Mappings merge key by key, None deletes a key, anything else replaces (a new object)."""
    if not (isinstance(target, dict) and isinstance(patch, dict)):
        return copy.deepcopy(patch)
    merged = copy.deepcopy(target)
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = merge_patch(merged.get(key), value)
    return merged


def json_patch(document: Any, operations: list[dict[str, Any]], where: str = "patch") -> Any:
    """RFC 6902 add, remove, replace and test (a new object)."""
    document = copy.deepcopy(document)
    for number, operation in enumerate(operations):
        op, path = operation.get("op"), operation.get("path", "")
        label = f"{where}: operation {number} ({op} {path})"
        *parents, last = _pointer(path, label)
        container = document
        for token in parents:
            container = _step(container, token, label)
        if op == "test":
            if _step(container, last, label) != operation.get("value"):
                raise RenderError(f"{label}: test failed, found {_step(container, last, label)!r}")
        elif op == "remove":
            if isinstance(container, list):
                del container[_index(container, last, label)]
            else:
                _step(container, last, label)
                del container[last]
        elif op in ("add", "replace"):
            value = copy.deepcopy(operation["value"])
            if isinstance(container, list):
                if op == "add":
                    position = len(container) if last == "-" else _index(container, last, label, allow_end=True)
                    container.insert(position, value)
                else:
                    container[_index(container, last, label)] = value
            elif isinstance(container, dict):
                if op == "replace":
                    _step(container, last, label)
                container[last] = value
            else:
                raise RenderError(f"{label}: parent is not a mapping or list")
        else:
            raise RenderError(f"{label}: unsupported op; use add, remove, replace or test")
    return document


def _pointer(path: str, label: str) -> list[str]:
    if not path.startswith("/"):
        raise RenderError(f"{label}: a JSON pointer starts with '/'")
    return [token.replace("~1", "/").replace("~0", "~") for token in path[1:].split("/")]


def _index(container: list, token: str, label: str, allow_end: bool = False) -> int:
    limit = len(container) + (1 if allow_end else 0)
    if not token.isdigit() or int(token) >= limit:
        raise RenderError(f"{label}: no list index {token!r} (length {len(container)})")
    return int(token)


def _step(container: Any, token: str, label: str) -> Any:
    if isinstance(container, list):
        return container[_index(container, token, label)]
    if isinstance(container, dict) and token in container:
        return container[token]
    raise RenderError(f"{label}: {token!r} does not exist")


def _set_image(node: Any, image: dict[str, str]) -> Any:
    """kustomize's image transformer: every ``containers`` / ``initContainers`` entry, any kind."""
    if isinstance(node, list):
        return [_set_image(item, image) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _set_image(value, image) for key, value in node.items()}
    for key in ("containers", "initContainers"):
        for container in out.get(key) or []:
            if isinstance(container, dict) and isinstance(container.get("image"), str):
                container["image"] = _new_image(container["image"], image)
    return out


def _new_image(current: str, image: dict[str, str]) -> str:
    if "@" in current:
        name, tag = current.split("@", 1)
        tag = "@" + tag
    else:
        slash = current.rfind("/")
        colon = current.rfind(":")
        name, tag = (current[:colon], current[colon:]) if colon > slash else (current, "")
    if name != image["name"]:
        return current
    if "digest" in image:
        tag = "@" + image["digest"]
    elif "newTag" in image:
        tag = ":" + str(image["newTag"])
    return image.get("newName", name) + tag


# --------------------------------------------------------------------------- serve config


def load_serve_config(path: Path) -> dict[str, Any]:
    config = yaml.safe_load(Path(path).read_text())
    if not isinstance(config, dict) or not config.get("applications"):
        raise RenderError(f"{path}: not a `serve run` config (no applications)")
    return config


def serve_config_text(config: dict[str, Any], source: str) -> str:
    header = f"# Rendered by deploy/render.py from {source}; edit that file, not this.\n"
    return header + yaml.safe_dump(config, sort_keys=False)


def inject_serve_config(manifests: list[Manifest], config: dict[str, Any], source: str) -> list[Manifest]:
    """Put ``config`` into the one RayService's ``spec.serveConfigV2`` (new objects)."""
    services = [i for i, m in enumerate(manifests) if m.get("kind") == "RayService"]
    if len(services) != 1:
        raise RenderError(f"expected one RayService in the rendered tree, found {len(services)}")
    out = copy.deepcopy(manifests)
    out[services[0]].setdefault("spec", {})["serveConfigV2"] = serve_config_text(config, source)
    return out


def render(overlay: str, config_path: Path, k8s_dir: Path = K8S_DIR) -> list[Manifest]:
    overlay_dir = k8s_dir / "overlays" / overlay
    if not overlay_dir.is_dir():
        known = sorted(p.name for p in (k8s_dir / "overlays").iterdir() if p.is_dir())
        raise RenderError(f"unknown overlay {overlay!r}; overlays: {', '.join(known)}")
    config_path = Path(config_path)
    source = str(config_path.resolve().relative_to(REPO)) if config_path.resolve().is_relative_to(REPO) else str(config_path)
    return inject_serve_config(build(overlay_dir), load_serve_config(config_path), source)


# --------------------------------------------------------------------------- output


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump(manifests: list[Manifest]) -> str:
    return yaml.dump_all(manifests, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)


def main(argv: list[str] | None = None) -> int:
    from deploy.checks import fit_errors

    parser = argparse.ArgumentParser(prog="python -m deploy.render", description=__doc__.split("\n\n")[0])
    parser.add_argument("--overlay", required=True, help="a directory name under k8s/overlays (gpu-efa, trainium)")
    parser.add_argument("--config", required=True, type=Path, help="the serve config, e.g. configs/gpu-xpyd-2p1d.yaml")
    parser.add_argument("--k8s-dir", type=Path, default=K8S_DIR, help="the kustomize tree (default: k8s/ of this checkout)")
    options = parser.parse_args(argv)
    try:
        manifests = render(options.overlay, options.config, options.k8s_dir)
        errors = fit_errors(manifests, load_serve_config(options.config))
    except (RenderError, OSError, yaml.YAMLError) as e:
        print(f"deploy.render: {e}", file=sys.stderr)
        return 2
    if errors:
        print(f"deploy.render: {options.config} does not fit overlay {options.overlay!r}:", file=sys.stderr)
        for error in errors:
            print(f"  {error}", file=sys.stderr)
        return 1
    sys.stdout.write(dump(manifests))
    return 0


if __name__ == "__main__":
    sys.exit(main())
