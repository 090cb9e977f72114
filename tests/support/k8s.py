"""The k8s/ overlays rendered with every deploy config they fit, and KubeRay's CRD schemas to validate them
against (``shared/schemas/``, or ``RENDEZVOUS_CRD_DIR``); shared by tests/unit/test_k8s*.py."""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from app.config.args import Accelerator, AppArgs
from tests.support.deploy import DEPLOY_CONFIGS, OVERLAYS, REPO

OVERLAY_ACCELERATOR = {"gpu-efa": Accelerator.GPU, "trainium": Accelerator.NEURON}


def config_accelerator(path: Path) -> Accelerator:
    (application,) = yaml.safe_load(path.read_text())["applications"]
    return AppArgs.parse(application.get("args")).accelerator


PAIRS = [
    pytest.param(overlay, path, id=f"{overlay}+{path.stem}")
    for overlay in OVERLAYS
    for path in DEPLOY_CONFIGS
    if config_accelerator(path) is OVERLAY_ACCELERATOR[overlay]
]


def by_kind(manifests, kind: str) -> list[dict[str, Any]]:
    return [m for m in manifests if m["kind"] == kind]


def rayservice(manifests) -> dict[str, Any]:
    (service,) = by_kind(manifests, "RayService")
    return service


def worker_groups(manifests) -> dict[str, dict[str, Any]]:
    return {g["groupName"]: g for g in rayservice(manifests)["spec"]["rayClusterConfig"]["workerGroupSpecs"]}


def _schema_dir() -> Path:
    candidates = [Path(os.environ["RENDEZVOUS_CRD_DIR"])] if "RENDEZVOUS_CRD_DIR" in os.environ else []
    candidates += [REPO / "shared" / "schemas", REPO.parent / "shared" / "schemas"]
    for candidate in candidates:
        if (candidate / "ray.io_rayservices.yaml").is_file():
            return candidate
    pytest.fail(f"KubeRay CRDs (ray.io_rayservices.yaml) not found in {[str(c) for c in candidates]}; "
                "set RENDEZVOUS_CRD_DIR")


def strict(schema: Any) -> Any:
    """The API server drops (or, with kubectl's default strict field validation, refuses) fields a
    structural schema does not name; jsonschema would accept them. Refuse them here too."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@cache
def crd_validators() -> dict[tuple[str, str], jsonschema.protocols.Validator]:
    validators = {}
    for path in sorted(_schema_dir().glob("ray.io_*.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for version in crd["spec"]["versions"]:
                schema = strict(version["schema"]["openAPIV3Schema"])
                # OpenAPI v3.0 schemas are closest to draft 4 (boolean exclusiveMinimum).
                validators[(f"{group}/{version['name']}", kind)] = jsonschema.Draft4Validator(schema)
    return validators


def schema_errors(manifest: dict[str, Any]) -> list[str]:
    validator = crd_validators()[(manifest["apiVersion"], manifest["kind"])]
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(manifest)]
