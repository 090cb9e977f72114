"""k8s/ and deploy/: rendered manifests against KubeRay's and the Prometheus Operator's CRD schemas,
`kubectl kustomize`, and the serve configs they carry (no cluster, no processes but `kubectl kustomize`
and node for the Prometheus Operator's validators)."""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.config.args import Accelerator, AppArgs
from app.config.llm_configs import deployment_config, placement_group_config
from app.ingress.proxy_gate import PROXY_ENV
from connector.ports import PortPlan, Role
from deploy import render as render_mod
from deploy.checks import (
    EFA_DEVICE,
    GPU_DEVICE,
    HUGEPAGES,
    NEURON_DEVICES,
    Group,
    app_args_of,
    fit_errors,
    parse_quantity,
    ray_start_resources,
    replica_need,
    replicas_per_pod,
)
from deploy.render import build, render
from tests.support.deploy import DEPLOY_CONFIGS, OVERLAYS, REPO, check_serve_config, rendered
from tests.support.images import GPU_DOCKERFILE, NEURON_DOCKERFILE, base_image, build_args, exact_pins, extra
from tests.support.k8s import (
    OVERLAY_ACCELERATOR,
    PAIRS,
    by_kind,
    config_accelerator,
    rayservice,
    schema_errors,
    worker_groups,
)

ROLE_GROUP = {Role.PREFILL: "prefill", Role.DECODE: "decode"}

MISMATCHED = [
    pytest.param(overlay, path, id=f"{overlay}+{path.stem}")
    for overlay in OVERLAYS
    for path in sorted((REPO / "configs").glob("*.yaml"))
    if config_accelerator(path) is not OVERLAY_ACCELERATOR[overlay]
]


def test_every_overlay_is_known_and_every_deploy_config_has_one():
    assert set(OVERLAYS) == set(OVERLAY_ACCELERATOR)
    assert {p.values[1] for p in PAIRS} == set(DEPLOY_CONFIGS)


# --------------------------------------------------------------------------- KubeRay CRD schemas


DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


@pytest.mark.parametrize("overlay, config", PAIRS)
def test_rendered_manifests_are_valid(overlay, config):
    manifests = rendered(overlay, config)
    assert sorted(m["kind"] for m in manifests) == ["PersistentVolumeClaim", "RayService", "Service"]
    for manifest in manifests:
        assert DNS_1123.match(manifest["metadata"]["name"]), manifest["metadata"]["name"]
        if manifest["apiVersion"] == "ray.io/v1":
            errors = schema_errors(manifest)
            assert errors == [], "\n".join(errors)
    (service,) = by_kind(manifests, "Service")
    assert service["apiVersion"] == "v1"
    assert service["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": 8000, "protocol": "TCP"}]


def test_the_schema_check_is_not_vacuous():
    manifests = copy.deepcopy(list(rendered("gpu-efa", REPO / "configs" / "gpu-p5en-qwen3-32b-push.yaml")))
    service = rayservice(manifests)
    cluster = service["spec"]["rayClusterConfig"]
    cluster["workerGroupSpecs"][0]["maxReplica"] = 2  # typo: an unknown field
    cluster["workerGroupSpecs"][1]["minReplicas"] = "one"  # wrong type
    del cluster["headGroupSpec"]["template"]  # required
    cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] = "lots"
    errors = "\n".join(schema_errors(service))
    assert "'maxReplica' was unexpected" in errors
    assert "'one' is not of type 'integer'" in errors
    assert "'template' is a required property" in errors
    assert "'lots'" in errors  # not a quantity


# --------------------------------------------------------------------------- Prometheus Operator CRD schemas

MONITORING = REPO / "k8s" / "monitoring"
PROM_OPERATOR = REPO / "tests" / "unit" / "prometheus-operator"  # package.json, validate.mjs, README.md


def _prometheus_operator_models() -> Path:
    """Where `make install` put the npm package that holds the operator's CRD schemas (README.md there)."""
    installed = REPO / ".tools" / "prometheus-operator"
    if not (installed / "node_modules" / "@kubernetes-models" / "prometheus-operator").is_dir():
        pytest.fail(f"the Prometheus Operator's CRD validators are not in {installed}: `make install` runs "
                    "npm ci there for tests/unit/prometheus-operator/package.json")
    return installed


def prometheus_operator_errors(manifests: list[dict[str, Any]]) -> list[list[str]]:
    """Per manifest, its errors against the PodMonitor / PrometheusRule CRD schema, unknown fields included."""
    node = shutil.which("node")
    if node is None:
        pytest.fail("node is not installed (the Prometheus Operator's CRD validators are an npm package)")
    done = subprocess.run([node, str(PROM_OPERATOR / "validate.mjs"), str(_prometheus_operator_models())],
                          input=json.dumps(manifests), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    (pinned,) = json.loads((PROM_OPERATOR / "package.json").read_text())["dependencies"].values()
    assert result["version"] == pinned, f"installed {result['version']}, pinned {pinned}: run `make install`"
    return result["errors"]


def test_monitoring_manifests_are_valid():
    manifests = build(MONITORING)
    assert sorted((m["apiVersion"], m["kind"]) for m in manifests) == [
        ("monitoring.coreos.com/v1", "PodMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule")]
    for manifest, errors in zip(manifests, prometheus_operator_errors(manifests), strict=True):
        assert DNS_1123.match(manifest["metadata"]["name"]), manifest["metadata"]["name"]
        assert errors == [], f"{manifest['kind']}:\n" + "\n".join(errors)


def test_the_monitoring_schema_check_is_not_vacuous():
    monitor, rule = (copy.deepcopy(next(m for m in build(MONITORING) if m["kind"] == kind))
                     for kind in ("PodMonitor", "PrometheusRule"))
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    endpoint["interval"] = 15  # wrong type
    endpoint["scrapeInterval"] = "15s"  # unknown field
    del monitor["spec"]["selector"]  # required
    alert = rule["spec"]["groups"][0]["rules"][0]
    alert["for"] = "2 minutes"  # not a Prometheus duration
    alert["severity"] = alert["labels"].pop("severity")  # a label put beside the rule: unknown field
    monitor_errors, rule_errors = map("\n".join, prometheus_operator_errors([monitor, rule]))
    assert "spec/podMetricsEndpoints/0/interval: must be string" in monitor_errors
    assert "spec/podMetricsEndpoints/0: 'scrapeInterval' was unexpected" in monitor_errors
    assert "spec: must have required property selector" in monitor_errors
    assert "spec/groups/0/rules/0/for: must match pattern" in rule_errors
    assert "spec/groups/0/rules/0: 'severity' was unexpected" in rule_errors
    assert prometheus_operator_errors([{"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor"}]) == [
        [": no schema for monitoring.coreos.com/v1 ServiceMonitor"]]


# --------------------------------------------------------------------------- serveConfigV2


@pytest.mark.parametrize("overlay, config", PAIRS)
def test_embedded_serve_config_is_the_config_and_passes_its_checks(overlay, config, monkeypatch):
    text = rayservice(rendered(overlay, config))["spec"]["serveConfigV2"]
    assert isinstance(text, str) and text.startswith(f"# Rendered by deploy/render.py from configs/{config.name}")
    embedded = yaml.safe_load(text)
    assert embedded == yaml.safe_load(config.read_text())
    check_serve_config(embedded, monkeypatch)


def test_base_holds_only_a_placeholder():
    (service,) = by_kind(build(REPO / "k8s" / "base"), "RayService")
    assert service["spec"]["serveConfigV2"] == render_mod.SERVE_CONFIG_PLACEHOLDER


# --------------------------------------------------------------------------- fit: resources, placement, ports


@pytest.mark.parametrize("overlay, config", PAIRS)
def test_config_fits_its_overlay(overlay, config):
    assert fit_errors(list(rendered(overlay, config)), yaml.safe_load(config.read_text())) == []


@pytest.mark.parametrize("overlay, config", MISMATCHED)
def test_config_for_other_hardware_does_not_fit(overlay, config):
    assert fit_errors(list(render(overlay, config)), yaml.safe_load(config.read_text())) != []


@pytest.mark.parametrize("overlay, config", PAIRS)
def test_devices_per_pod_times_pods_cover_tp_times_replicas(overlay, config):
    """Spelled out here without deploy.checks: devices (GPUs or NeuronCores) x pods >= TP x replicas."""
    manifests = rendered(overlay, config)
    args = app_args_of(yaml.safe_load(config.read_text()))
    groups = worker_groups(manifests)
    for role in Role:
        group = groups[ROLE_GROUP[role]]
        container = group["template"]["spec"]["containers"][0]
        kwargs = args.engine_kwargs_for(role)
        devices_per_replica = kwargs.get("tensor_parallel_size", 1) * kwargs.get("pipeline_parallel_size", 1)
        if args.accelerator is Accelerator.GPU:
            per_pod = parse_quantity(container["resources"]["limits"][GPU_DEVICE])
            devices_per_replica *= args.role(role).gpus
            assert float(group["rayStartParams"].get("num-gpus", per_pod)) == per_pod
        else:
            assert parse_quantity(container["resources"]["limits"][NEURON_DEVICES[0]]) > 0
            per_pod = ray_start_resources(group["rayStartParams"]["resources"])["neuron_cores"]
        fit = int(per_pod // devices_per_replica)
        assert fit >= 1, f"{role.value}: a replica ({devices_per_replica}) is bigger than a pod ({per_pod})"
        assert fit * group["maxReplicas"] >= args.role(role).max_replicas
        assert fit * group["replicas"] >= args.role(role).min_replicas
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        # EFA for NIXL over libfabric, with its hugepages, and a memory-backed /dev/shm.
        limits = container["resources"]["limits"]
        assert parse_quantity(limits[EFA_DEVICE]) >= 1 and parse_quantity(limits[HUGEPAGES]) > 0
        assert container["resources"]["requests"] == limits
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1" and env["FI_EFA_FORK_SAFE"] == "1"
        volumes = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
        shm = next(m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm")
        assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"


@pytest.mark.parametrize("overlay, config", PAIRS)
def test_head_has_no_accelerators(overlay, config):
    head = rayservice(rendered(overlay, config))["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    container = head["template"]["spec"]["containers"][0]
    assert not {GPU_DEVICE, EFA_DEVICE, *NEURON_DEVICES} & set(container["resources"]["limits"])
    assert "resources" not in head["rayStartParams"]


@pytest.mark.parametrize("overlay, config", PAIRS)
def test_pods_drain_keep_their_model_cache_tolerate_efa_and_expose_metrics(overlay, config):
    manifests = rendered(overlay, config)
    (claim,) = by_kind(manifests, "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # prefill and decode pods on several nodes
    cluster = rayservice(manifests)["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]["template"]["spec"]
    assert "ray stop" in head["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][-1]
    assert {"name": "metrics", "containerPort": 8080} in head["containers"][0]["ports"]
    for group in cluster["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        container = pod["containers"][0]
        drain = container["lifecycle"]["preStop"]["exec"]["command"][-1]
        assert drain.startswith("sleep ") and drain.endswith("ray stop"), drain
        assert pod["terminationGracePeriodSeconds"] > int(drain.split()[1].rstrip(";")), group["groupName"]
        assert {"name": "metrics", "containerPort": 8080} in container["ports"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["model-cache"] == {"name": "model-cache", "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]}}
        if EFA_DEVICE in container["resources"]["limits"]:
            assert {"key": EFA_DEVICE, "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"], group["groupName"]
    # The PodMonitor (k8s/monitoring) finds these pods and their port by name.
    monitor = yaml.safe_load((REPO / "k8s" / "monitoring" / "podmonitor.yaml").read_text())
    labels = [g["template"]["metadata"]["labels"] for g in cluster["workerGroupSpecs"]]
    labels.append(cluster["headGroupSpec"]["template"]["metadata"]["labels"])
    for pod_labels in labels:
        assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]


@pytest.mark.parametrize("overlay, config", PAIRS)
def test_prefill_and_decode_land_on_their_own_groups(overlay, config):
    manifests = rendered(overlay, config)
    args = app_args_of(yaml.safe_load(config.read_text()))
    groups = worker_groups(manifests)
    offered = {name: ray_start_resources(g["rayStartParams"].get("resources")) for name, g in groups.items()}
    for role in Role:
        own = ROLE_GROUP[role]
        for key in args.role(role).resources:
            assert [name for name, res in offered.items() if res.get(key, 0) > 0] == [own], key
        selector = groups[own]["template"]["spec"]["nodeSelector"]
        assert selector["rendezvous/node-group"] == own
        tolerations = groups[own]["template"]["spec"]["tolerations"]
        assert {"key": "rendezvous/node-group", "operator": "Equal", "value": own, "effect": "NoSchedule"} in tolerations
    selectors = [json.dumps(g["template"]["spec"]["nodeSelector"], sort_keys=True) for g in groups.values()]
    assert len(set(selectors)) == len(selectors), "worker groups share a node selector"


@pytest.mark.parametrize("overlay, config", PAIRS)
def test_side_channel_ports_cannot_collide_on_a_node(overlay, config):
    """Up to `per_pod` replicas share a pod, and which ranks they are is up to Serve: so the ports
    of all ranks below max_replicas (per DP rank) must be distinct, clear of the other role's
    (whose group is another) and of Ray's own ports."""
    manifests = rendered(overlay, config)
    args = app_args_of(yaml.safe_load(config.read_text()))
    plan: PortPlan = args.nixl.port_plan()
    ray_worker_ports = range(10002, 20000)
    used: dict[int, str] = {}
    for role in Role:
        group = Group.from_spec(ROLE_GROUP[role], worker_groups(manifests)[ROLE_GROUP[role]], head=False)
        per_pod = replicas_per_pod(replica_need(args, role), group.offers)
        assert 1 <= per_pod
        dp = int(args.engine_kwargs_for(role).get("data_parallel_size") or 1)
        ports = plan.ports(role, args.role(role).max_replicas, dp)
        assert len(ports) == len(set(ports)) == args.role(role).max_replicas * dp
        for port in ports:
            assert port not in used, f"{role.value} port {port} is also {used[port]}'s"
            assert port not in ray_worker_ports and port not in group.reserved_ports
            used[port] = role.value


# num_key_value_heads in the config.json of each model a Trainium config serves.
MODEL_KV_HEADS = {"Qwen/Qwen3-32B": 8}
# Logical NeuronCores of a node: 16 Trainium2 chips x 4 at the default LNC=2.
INSTANCE_NEURON_CORES = {"trn2.48xlarge": 64}
TRAINIUM_CONFIGS = [path for path in DEPLOY_CONFIGS if config_accelerator(path) is Accelerator.NEURON]


@pytest.mark.parametrize("config", TRAINIUM_CONFIGS, ids=lambda p: p.stem)
def test_trainium_tp_is_the_kv_heads_and_a_node_holds_its_engines(config):
    """Above the KV heads the Neuron plugin replicates each head (TP 64: 8 copies, so 8 times the KV staged
    through host memory per transfer). At TP = KV heads several engines share a node: they must fit its
    cores, and each replica must hold its cores itself, the only way Ray gives each engine its own
    NEURON_RT_VISIBLE_CORES."""
    args = app_args_of(yaml.safe_load(config.read_text()))
    groups = worker_groups(rendered("trainium", config))
    for role in Role:
        kwargs = args.engine_kwargs_for(role)
        tp = kwargs["tensor_parallel_size"] * kwargs.get("pipeline_parallel_size", 1)
        assert tp == MODEL_KV_HEADS[args.model.id], f"{role.value}: TP {tp}"
        group = groups[ROLE_GROUP[role]]
        cores = INSTANCE_NEURON_CORES[group["template"]["spec"]["nodeSelector"]["node.kubernetes.io/instance-type"]]
        assert ray_start_resources(group["rayStartParams"]["resources"])["neuron_cores"] == cores
        on_a_node = math.ceil(args.role(role).max_replicas / group["replicas"])  # one pod a node
        assert on_a_node * tp <= cores, f"{role.value}: {on_a_node} engines of TP {tp} on {cores} cores"
        assert on_a_node * tp == cores, f"{role.value}: {cores - on_a_node * tp} cores left idle"
        assert deployment_config(args, role)["ray_actor_options"]["resources"] == {"neuron_cores": tp}
        assert not any("neuron_cores" in b for b in placement_group_config(args, role)["bundles"])


def test_fit_errors_count_the_neuron_cores_a_replica_holds_itself():
    """A Neuron replica's cores are the replica actor's, not its bundle's: a ninth TP-8 engine needs a second node."""
    config_path = REPO / "configs" / "trn2-qwen3-32b-push.yaml"
    config = yaml.safe_load(config_path.read_text())
    assert fit_errors(list(rendered("trainium", config_path)), config) == []
    config["applications"][0]["args"]["decode"]["replicas"] = 9
    manifests = render_mod.inject_serve_config(copy.deepcopy(list(rendered("trainium", config_path))), config, "test")
    errors = fit_errors(manifests, config)
    assert any("decode: up to 9 replicas at 8 per pod need 2 pods; group 'decode' has at most 1" in e for e in errors), errors


# --------------------------------------------------------------------------- fit_errors catches mistakes


def _broken(mutate) -> list[str]:
    config_path = REPO / "configs" / "gpu-xpyd-2p1d.yaml"
    manifests = copy.deepcopy(list(rendered("gpu-efa", config_path)))
    config = yaml.safe_load(config_path.read_text())
    mutate(manifests, config)
    manifests = render_mod.inject_serve_config(manifests, config, "test") if config else manifests
    return fit_errors(manifests, config)


def _groups(manifests):
    return rayservice(manifests)["spec"]["rayClusterConfig"]["workerGroupSpecs"]


def _args(config):
    return config["applications"][0]["args"]


@pytest.mark.parametrize(
    "mutate, fragment",
    [
        (lambda m, c: _groups(m)[0].update(maxReplicas=1), "up to 4 replicas at 2 per pod need 2 pods; group 'prefill' has at most 1"),
        (lambda m, c: rayservice(m)["spec"]["rayClusterConfig"].update(enableInTreeAutoscaling=False), "enableInTreeAutoscaling is off"),
        (lambda m, c: _args(c)["prefill"]["autoscaling"].update(min_replicas=3), "3 replicas at start need 2 pods; group 'prefill' starts 1"),
        (lambda m, c: _args(c)["decode"]["engine_kwargs"].update(tensor_parallel_size=16), "one replica does not fit one pod of group 'decode'"),
        (lambda m, c: _groups(m)[1]["rayStartParams"].update(resources='"{\\"prefill_group\\": 1}"'), "offered by prefill, decode"),
        (lambda m, c: _args(c)["decode"].update(resources={"prefill_group": 0.01}), "prefill and decode both land on worker group 'prefill'"),
        (lambda m, c: _args(c)["decode"].pop("resources"), "decode.resources is empty"),
        (lambda m, c: _args(c)["decode"].update(resources={"gpu_group": 0.01}), "offered by no group"),
        (lambda m, c: rayservice(m)["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"].update(
            resources='"{\\"decode_group\\": 1}"'), "offered by head, decode"),
        (lambda m, c: rayservice(m)["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"].pop("num-gpus"), "num-gpus must be \"0\""),
        (lambda m, c: _args(c)["ingress"].update(on_head=True), "the ingress (on_head) needs 2 x 1 there"),  # the head offers 0 CPUs
        (lambda m, c: _groups(m)[0]["template"]["spec"]["containers"][0]["resources"]["limits"].pop(EFA_DEVICE), "requests no vpc.amazonaws.com/efa"),
        (lambda m, c: _groups(m)[1]["template"]["spec"]["containers"][0]["resources"]["limits"].pop(HUGEPAGES), "requests no hugepages-2Mi"),
        (lambda m, c: _groups(m)[1]["template"]["spec"]["containers"][0]["resources"]["limits"].update({EFA_DEVICE: 8}),
         "requests 16 vpc.amazonaws.com/efa but its limit is 8.0"),
        (lambda m, c: _groups(m)[0]["rayStartParams"].update({"num-gpus": "16"}), "Ray is told of 16 GPUs but the pod requests 8"),
        (lambda m, c: _args(c)["prefill"]["env"].update(FI_PROVIDER="tcp"), "FI_PROVIDER is 'tcp' in the config but 'efa' in the pod"),
        (lambda m, c: _groups(m)[0]["template"]["spec"]["volumes"][0].update(emptyDir={}), "/dev/shm is not a memory-backed emptyDir"),
        (lambda m, c: _groups(m)[0]["rayStartParams"].update({"max-worker-port": "25000"}), "side-channel port 20000 of prefill is in Ray's worker port range"),
        (lambda m, c: _groups(m)[1]["rayStartParams"].update({"metrics-export-port": "22001"}), "side-channel port 22001 of decode is Ray (metrics-export-port)'s"),
        (lambda m, c: c["http_options"].update(host="127.0.0.1"), "http_options.host is '127.0.0.1'"),
        (lambda m, c: c["http_options"].update(port=9000), "no port targets Serve's HTTP port 9000"),
        (lambda m, c: by_kind(m, "Service")[0]["spec"]["selector"].update({"app.kubernetes.io/name": "other"}), "does not match the head pod's labels"),
    ],
)
def test_fit_errors_name_the_problem(mutate, fragment):
    errors = _broken(mutate)
    assert any(fragment in e for e in errors), "\n".join(errors)


def test_fit_errors_see_a_stale_serve_config():
    manifests = list(rendered("gpu-efa", REPO / "configs" / "gpu-xpyd-2p1d.yaml"))
    other = yaml.safe_load((REPO / "configs" / "gpu-multiturn-push.yaml").read_text())
    assert "RayService spec.serveConfigV2 is not the serve config (render it with deploy.render)" in fit_errors(manifests, other)


# --------------------------------------------------------------------------- versions and docs agree


def _pinned_ray() -> str:
    """Ray as pyproject.toml's gpu extra pins it (ray[serve]; ray[llm] is listed by hand, test_images.py)."""
    return exact_pins(extra("gpu"))["ray"]


def test_ray_version_is_the_same_everywhere():
    ray_version = _pinned_ray()
    assert exact_pins(extra("cpu"))["ray"] == ray_version
    base = yaml.safe_load((REPO / "k8s" / "base" / "rayservice.yaml").read_text())
    assert base["spec"]["rayClusterConfig"]["rayVersion"] == ray_version
    # The images: Ray's own for GPUs (Python 3.11, the version the project is developed and tested on),
    # Ray installed on the Neuron SDK for Trainium. tests/unit/test_images.py checks their other pins.
    assert re.fullmatch(rf"rayproject/ray:{re.escape(ray_version)}-py311-cu\d+", base_image(GPU_DOCKERFILE))
    assert re.search(r'pip install[^\n]*"\.\[gpu\]"', GPU_DOCKERFILE.read_text())
    assert build_args(NEURON_DOCKERFILE)["RAY_VERSION"] == ray_version


def test_docs_name_only_files_that_exist():
    text = (REPO / "docs" / "deploy-eks.md").read_text()
    paths = set(re.findall(r"\b((?:configs|k8s|deploy|docker|connector|app)/[\w./-]*\w)", text))
    assert paths
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert not missing, missing


@pytest.mark.parametrize("rel", sorted(str(p.relative_to(REPO)) for p in (REPO / "deploy").glob("*.py")))
def test_deploy_stays_pure(rel):
    """deploy/ runs wherever manifests are rendered: no Ray, vLLM or torch, directly or through
    the repository modules it uses (which must be ones test_layering keeps pure)."""
    from tests.support.layering import HEAVY, PURE, imports_of

    imports = imports_of(rel)
    assert not [str(i) for i in imports if i.top in HEAVY]
    ours = {i.module.replace(".", "/") + ".py" for i in imports if i.top in ("app", "connector")}
    assert ours <= set(PURE), sorted(ours - set(PURE))


@pytest.mark.parametrize("overlay, config", PAIRS)
def test_every_pod_gets_the_api_key_the_config_names_and_the_proxy_gate(overlay, config):
    """ingress.api_key_env: any pod may host an ingress replica, so every container gets the
    variable, from the Secret docs/deploy-eks.md says to create. Any pod may run a proxy, so every
    one installs the starting gate (app.ingress.proxy_gate)."""
    (application,) = yaml.safe_load(config.read_text())["applications"]
    name = AppArgs.parse(application["args"]).ingress.api_key_env
    assert name, f"{config}: the k8s configs turn bearer auth on"
    cluster = rayservice(rendered(overlay, config))["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        env = {e["name"]: e for e in group["template"]["spec"]["containers"][0].get("env", [])}
        assert env[name]["valueFrom"]["secretKeyRef"] == {"name": "rendezvous-api-key", "key": "api-key"}
        assert {k: env.get(k, {}).get("value") for k in PROXY_ENV} == PROXY_ENV, group.get("groupName", "head")


@pytest.mark.parametrize("overlay, config", PAIRS)
def test_worker_pods_are_ready_when_the_app_can_answer_and_the_head_keeps_kuberays_probes(overlay, config):
    """Workers: readiness on the app's /ready (app.ingress.readiness) at the Serve port of the config.
    The head: none of ours, or KubeRay would never submit the app (it waits for a ready head)."""
    manifests = rendered(overlay, config)
    port = (yaml.safe_load(config.read_text()).get("http_options") or {}).get("port", 8000)
    for name, group in worker_groups(manifests).items():
        (container,) = group["template"]["spec"]["containers"]
        assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": port}, name
        assert "livenessProbe" not in container, name  # KubeRay's default: the raylet
    head = rayservice(manifests)["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "readinessProbe" not in head and "livenessProbe" not in head
