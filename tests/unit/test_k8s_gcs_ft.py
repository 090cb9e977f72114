"""GCS fault tolerance and the upgrade strategy (k8s/components/gcs-ft, k8s/base, deploy/resilience.py), on
the rendered manifests: what they hand KubeRay, and what deploy.checks refuses. No cluster: the head-restart
drill itself is not run here."""

from __future__ import annotations

import copy
import re

import pytest
import yaml

from app.config.args import AppArgs
from app.ingress.proxy_gate import PROXY_ENV
from deploy import render as render_mod
from deploy.checks import Group, fit_errors
from deploy.render import build
from deploy.resilience import UPGRADE_TYPES
from tests.support.deploy import OVERLAYS, REPO, build_serve_app, rendered
from tests.support.k8s import PAIRS, by_kind, crd_validators, rayservice, schema_errors

RUNBOOK = REPO / "docs" / "runbook.md"


def _spec(manifests) -> dict:
    return rayservice(manifests)["spec"]


def _head(manifests) -> Group:
    return Group.from_spec("head", _spec(manifests)["rayClusterConfig"]["headGroupSpec"], head=True)


@pytest.mark.parametrize("overlay, config", PAIRS)
def test_overlays_turn_gcs_ft_on_within_the_crd_schema(overlay, config):
    service = rayservice(rendered(overlay, config))
    options = service["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    assert options["redisAddress"].startswith("rediss://")
    assert schema_errors(service) == []
    typo = copy.deepcopy(service)
    typo["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]["redisPasword"] = options["redisPassword"]
    assert any("'redisPasword' was unexpected" in e for e in schema_errors(typo))


def test_the_base_builds_without_redis_and_every_overlay_adds_it():
    """The base stays usable on a cluster without Redis; the component is the one place GCS FT lives."""
    (base,) = by_kind(build(REPO / "k8s" / "base"), "RayService")
    assert "gcsFaultToleranceOptions" not in base["spec"]["rayClusterConfig"]
    assert "num-cpus" not in base["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]
    for overlay in OVERLAYS:
        (service,) = by_kind(build(REPO / "k8s" / "overlays" / overlay), "RayService")
        assert "gcsFaultToleranceOptions" in service["spec"]["rayClusterConfig"], overlay


@pytest.mark.parametrize("overlay, config", PAIRS)
def test_the_redis_password_comes_from_the_secret_the_runbook_creates(overlay, config):
    spec = _spec(rendered(overlay, config))
    password = spec["rayClusterConfig"]["gcsFaultToleranceOptions"]["redisPassword"]
    assert set(password) == {"valueFrom"} and set(password["valueFrom"]) == {"secretKeyRef"}
    ref = password["valueFrom"]["secretKeyRef"]
    # KubeRay puts it into the head's env itself; a second copy anywhere would be a literal or a conflict.
    cluster = spec["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        assert "redis-password" not in group["rayStartParams"]
        assert not {"REDIS_PASSWORD", "RAY_REDIS_ADDRESS"} & {e["name"] for e in group["template"]["spec"]["containers"][0].get("env", [])}
    created = re.findall(r"kubectl create secret generic (\S+) --from-literal=([\w.-]+)=", RUNBOOK.read_text())
    assert (ref["name"], ref["key"]) in created, created


@pytest.mark.parametrize("overlay, config", PAIRS)
def test_with_gcs_ft_no_request_path_runs_through_the_head(overlay, config, monkeypatch):
    """The ingress deployment the app builds from the embedded config cannot land on the head (it asks CPU,
    the head offers none, and nothing pins it there), every node runs a proxy, and KubeRay keeps the head
    out of the Services (ray.io/serve false on it; ours selects ray.io/serve=true)."""
    from ray._common.constants import HEAD_NODE_RESOURCE_NAME
    from ray.serve.config import ProxyLocation
    from ray.serve.schema import ServeDeploySchema

    manifests = rendered(overlay, config)
    embedded = yaml.safe_load(_spec(manifests)["serveConfigV2"])
    schema = ServeDeploySchema.model_validate(embedded)
    assert schema.proxy_location == ProxyLocation.EveryNode
    deployments = build_serve_app(AppArgs.parse(schema.applications[0].args), monkeypatch)
    options = deployments["OpenAiIngress"].ray_actor_options
    assert HEAD_NODE_RESOURCE_NAME not in (options.get("resources") or {})
    assert options["num_cpus"] > _head(manifests).offers["CPU"] == 0
    assert _spec(manifests)["excludeHeadPodFromServeSvc"] is True
    (service,) = by_kind(manifests, "Service")
    assert service["spec"]["selector"]["ray.io/serve"] == "true"


@pytest.mark.parametrize("overlay, config", PAIRS)
def test_the_upgrade_strategy_is_set_to_one_kuberay_accepts(overlay, config):
    """The CRD's schema takes any string here (KubeRay's controller refuses other values), so the schema
    check alone would pass a typo: compare with the CRD where it has an enum, and with KubeRay's list."""
    spec = _spec(rendered(overlay, config))
    kind = spec["upgradeStrategy"]["type"]
    crd_type = crd_validators()[("ray.io/v1", "RayService")].schema["properties"]["spec"]["properties"]["upgradeStrategy"]["properties"]["type"]
    assert crd_type["type"] == "string" and kind in crd_type.get("enum", UPGRADE_TYPES)
    assert kind in UPGRADE_TYPES
    assert "upgradeStrategy" not in spec["rayClusterConfig"]  # the RayCluster's (Recreate, None): refused here


# --------------------------------------------------------------------------- what deploy.checks refuses

CONFIG = REPO / "configs" / "gpu-p5en-qwen3-32b-push.yaml"


def _errors(mutate) -> list[str]:
    manifests = copy.deepcopy(list(rendered("gpu-efa", CONFIG)))
    config = yaml.safe_load(CONFIG.read_text())
    mutate(_spec(manifests), config)
    return fit_errors(render_mod.inject_serve_config(manifests, config, "test"), config)


def _options(spec):
    return spec["rayClusterConfig"]["gcsFaultToleranceOptions"]


def _head_params(spec):
    return spec["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]


def _head_env(spec):
    return spec["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]


@pytest.mark.parametrize(
    "mutate, fragment",
    [
        # the request path
        (lambda s, c: c["applications"][0]["args"]["ingress"].update(on_head=True), "ingress.on_head is true"),
        (lambda s, c: _head_params(s).update({"num-cpus": "8"}), "the head offers Ray 8 CPUs"),
        (lambda s, c: _head_params(s).pop("num-cpus"), "the head offers Ray 8 CPUs"),  # KubeRay: the CPU limit
        (lambda s, c: c.update(proxy_location="HeadOnly"), "proxy_location 'HeadOnly'"),
        (lambda s, c: s.pop("excludeHeadPodFromServeSvc"), "excludeHeadPodFromServeSvc is not true"),
        # Redis and the password
        (lambda s, c: _options(s).update(redisPassword={"value": "hunter2"}), "redisPassword: a literal"),
        (lambda s, c: _options(s).update(redisPassword={"valueFrom": {"configMapKeyRef": {"name": "a", "key": "b"}}}),
         "redisPassword: a literal or non-Secret source"),
        (lambda s, c: _options(s).pop("redisPassword"), "no valueFrom.secretKeyRef"),
        (lambda s, c: _options(s).update(redisAddress="redis://redis:6379"), "not rediss:// (TLS)"),
        (lambda s, c: _options(s).update(redisAddress="rediss://redis"), "Ray takes host:port"),
        (lambda s, c: _options(s).update(externalStorageNamespace="rendezvous"), "would share it in Redis"),
        (lambda s, c: _options(s).update(backend="rocksdb"), "only the Redis backend"),
        # what KubeRay refuses beside gcsFaultToleranceOptions
        (lambda s, c: _head_params(s).update({"redis-password": "$REDIS_PASSWORD"}), "rayStartParams redis-password"),
        (lambda s, c: _head_env(s).append({"name": "RAY_REDIS_ADDRESS", "value": "rediss://r:6379"}), "env RAY_REDIS_ADDRESS"),
        (lambda s, c: _head_env(s).append({"name": "REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {"name": "a", "key": "b"}}}),
         "env REDIS_PASSWORD"),
        # the upgrade strategy
        (lambda s, c: s.pop("upgradeStrategy"), "spec.upgradeStrategy.type is unset"),
        (lambda s, c: s["upgradeStrategy"].update(type="Recreate"), "'Recreate': KubeRay accepts NewCluster"),
        (lambda s, c: s["rayClusterConfig"].update(upgradeStrategy={"type": "Recreate"}), "the RayCluster's own"),
        (lambda s, c: s["upgradeStrategy"].update(type="NewClusterWithIncrementalUpgrade"), "needs clusterUpgradeOptions"),
        (lambda s, c: s.update(upgradeStrategy={"type": "NewClusterWithIncrementalUpgrade", "clusterUpgradeOptions": {
            "gatewayClassName": "istio", "stepSizePercent": 50, "maxSurgePercent": 25, "intervalSeconds": 30}}),
         "stepSizePercent 50 must be within 0 and maxSurgePercent (25)"),
        (lambda s, c: s.update(upgradeStrategy={"type": "NewClusterWithIncrementalUpgrade", "clusterUpgradeOptions": {
            "gatewayClassName": "istio", "stepSizePercent": 10, "intervalSeconds": 30}})
         or s["rayClusterConfig"].update(enableInTreeAutoscaling=False), "needs Ray's autoscaler"),
    ],
)
def test_fit_errors_name_what_breaks_a_head_restart_or_an_upgrade(mutate, fragment):
    errors = _errors(mutate)
    assert any(fragment in e for e in errors), "\n".join(errors)


def test_valid_incremental_upgrade_options_pass():
    options = {"gatewayClassName": "istio", "stepSizePercent": 10, "maxSurgePercent": 20, "intervalSeconds": 60}
    assert _errors(lambda s, c: s.update(upgradeStrategy={"type": "NewClusterWithIncrementalUpgrade",
                                                          "clusterUpgradeOptions": options})) == []


def test_without_gcs_ft_the_head_may_keep_the_ingress():
    """The head-restart rules apply only where the head's state survives; the base's own head is fine."""
    def no_ft(spec, config):
        spec["rayClusterConfig"].pop("gcsFaultToleranceOptions")
        spec.pop("excludeHeadPodFromServeSvc")
        _head_params(spec).pop("num-cpus")
        config["applications"][0]["args"]["ingress"]["on_head"] = True

    assert _errors(no_ft) == []


def _with_ingress_group(tmp_path) -> list[dict]:
    """The gpu-efa overlay with k8s/components/ingress-group added, as a user would add it."""
    import shutil

    k8s = tmp_path / "k8s"
    shutil.copytree(REPO / "k8s", k8s)
    kustomization = k8s / "overlays" / "gpu-efa" / "kustomization.yaml"
    text = yaml.safe_load(kustomization.read_text())
    text["components"].append("../../components/ingress-group")
    kustomization.write_text(yaml.safe_dump(text))
    return build(k8s / "overlays" / "gpu-efa")


def test_the_ingress_group_component_pins_the_ingress_off_the_engine_nodes(tmp_path, monkeypatch):
    """With the component and ``ingress.resources: {ingress_group: ...}``, the rendering passes the checks and the
    CRD schema, and the ingress deployment asks for the resource only that group offers; without the component the
    same config is refused, naming it."""
    manifests = _with_ingress_group(tmp_path)
    config = yaml.safe_load(CONFIG.read_text())
    config["applications"][0]["args"]["ingress"].update(resources={"ingress_group": 0.01}, replicas=2)
    injected = render_mod.inject_serve_config(manifests, config, "test")
    assert fit_errors(injected, config) == []
    assert schema_errors(rayservice(injected)) == []
    groups = {g["groupName"]: g for g in _spec(injected)["rayClusterConfig"]["workerGroupSpecs"]}
    assert list(groups)[-1] == "ingress" and "ingress_group" in groups["ingress"]["rayStartParams"]["resources"]
    env = {e["name"]: e.get("value") for e in groups["ingress"]["template"]["spec"]["containers"][0]["env"]}
    assert PROXY_ENV.items() <= env.items(), "its proxies answer at once while the ingress starts (proxy_gate)"
    deployments = build_serve_app(AppArgs.parse(config["applications"][0]["args"]), monkeypatch)
    assert deployments["OpenAiIngress"].ray_actor_options["resources"] == {"ingress_group": 0.01}

    without = render_mod.inject_serve_config(copy.deepcopy(list(rendered("gpu-efa", CONFIG))), config, "test")
    assert any("ingress.resources ['ingress_group']: offered by no worker group" in e and "ingress-group" in e
               for e in fit_errors(without, config))
