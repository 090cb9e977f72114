"""Does a serve config fit the Ray cluster that rendered manifests describe? (pure)

``fit_errors(manifests, serve_config)`` returns one readable line per problem; ``[]`` means it
fits. It reads each pod's Ray resources as KubeRay hands them to ``ray start`` (rayStartParams,
else the container's limits) and each replica's needs from the placement bundles and replica
actor resources that ``app.config.llm_configs`` builds, and checks:

* placement: each role asks for custom resources that exactly one worker group offers, prefill's
  and decode's groups differ, and the head (``num-gpus: 0``, no accelerators) offers neither;
* capacity: a replica fits one pod (STRICT_PACK), and the group's pods cover the role's
  replicas: ``replicas`` pods for the fewest, ``maxReplicas`` pods for the most;
* hardware: Ray's GPUs / NeuronCores are backed by the pod's k8s device requests, and with the
  LIBFABRIC backend the pods request EFA interfaces and 2 MiB hugepages and the engines see
  ``FI_PROVIDER=efa``; /dev/shm is memory-backed; FI_* settings agree between pod and config;
* ports: the NIXL side-channel ports of every replica that may land on one pod (connector.ports)
  are distinct and clear of Ray's own ports;
* head restarts and upgrades: ``deploy.resilience`` (GCS fault tolerance, the upgrade strategy);
* the Service reaches Serve's HTTP port, and serveConfigV2 holds exactly this config.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import yaml

from app.config.args import Accelerator, AppArgs
from app.config.llm_configs import placement_group_config, replica_actor_resources
from connector.ports import Role
from deploy.resilience import resilience_errors

GPU_DEVICE = "nvidia.com/gpu"
NEURON_DEVICES = ("aws.amazon.com/neuron", "aws.amazon.com/neuroncore", "aws.amazon.com/neurondevice")
EFA_DEVICE = "vpc.amazonaws.com/efa"
HUGEPAGES = "hugepages-2Mi"
ACCELERATOR_DEVICES = (GPU_DEVICE, *NEURON_DEVICES, EFA_DEVICE)
# Ports `ray start` binds by default (rayStartParams can move them), and its worker port range.
RAY_PORT_PARAMS = {"port": 6379, "dashboard-port": 8265, "ray-client-server-port": 10001, "metrics-export-port": 8080,
                   "dashboard-agent-listen-port": 52365}
RAY_WORKER_PORTS = (10002, 19999)
APP_IMPORT_PATH = "app.builder:build_app"

_SUFFIX = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")


def parse_quantity(value: Any) -> float:
    """A Kubernetes quantity ("500m", "64Gi", 8) as a number."""
    if isinstance(value, (int, float)):
        return float(value)
    match = _QUANTITY.match(str(value).strip())
    if not match:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    return float(match.group(1)) * _SUFFIX[match.group(2) or ""]


def ray_start_resources(value: str | None) -> dict[str, float]:
    """rayStartParams ``resources``: JSON, usually wrapped in shell quotes ('"{\\"a\\": 1}"')."""
    if not value:
        return {}
    text = value.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        text = text[1:-1].replace('\\"', '"')
    parsed = json.loads(text)
    if not isinstance(parsed, dict):
        raise ValueError(f"rayStartParams resources is not a JSON object: {value!r}")
    return {str(k): float(v) for k, v in parsed.items()}


@dataclass(frozen=True)
class Group:
    """One KubeRay group (the head or a worker group), as Ray and Kubernetes see one pod of it."""

    name: str
    replicas: int
    min_replicas: int
    max_replicas: int
    offers: dict[str, float]  # Ray resources of one pod
    limits: dict[str, float]  # the Ray container's limits
    requests: dict[str, float]  # ... and requests
    env: dict[str, str]  # literal values only
    labels: dict[str, str]
    shm_in_memory: bool
    reserved_ports: dict[int, str] = field(default_factory=dict)  # port -> what uses it
    worker_ports: tuple[int, int] = RAY_WORKER_PORTS
    start_params: dict[str, str] = field(default_factory=dict)
    env_names: frozenset[str] = frozenset()  # every variable, literal or valueFrom

    @classmethod
    def from_spec(cls, name: str, spec: dict[str, Any], *, head: bool) -> "Group":
        params = {str(k): str(v) for k, v in (spec.get("rayStartParams") or {}).items()}
        pod = spec.get("template", {}).get("spec", {})
        container = (pod.get("containers") or [{}])[0]
        resources = container.get("resources") or {}
        limits = {k: parse_quantity(v) for k, v in (resources.get("limits") or {}).items()}
        requests = {k: parse_quantity(v) for k, v in (resources.get("requests") or {}).items()}
        offers = ray_start_resources(params.get("resources"))
        # KubeRay: num-cpus from the CPU limit, else the request.
        cpus = params.get("num-cpus") or limits.get("cpu") or requests.get("cpu")
        offers["CPU"] = float(math.ceil(parse_quantity(cpus))) if cpus is not None else 0.0
        gpus = params.get("num-gpus") if "num-gpus" in params else limits.get(GPU_DEVICE, 0)
        offers["GPU"] = parse_quantity(gpus)
        volumes = {v.get("name"): v for v in pod.get("volumes") or []}
        shm = any(
            m.get("mountPath") == "/dev/shm" and (volumes.get(m.get("name"), {}).get("emptyDir") or {}).get("medium") == "Memory"
            for m in container.get("volumeMounts") or []
        )
        reserved = {int(params.get(p, d)): f"Ray ({p})" for p, d in RAY_PORT_PARAMS.items()}
        reserved.update({int(p["containerPort"]): f"container port {p.get('name', '')}".strip() for p in container.get("ports") or []})
        worker_ports = (int(params.get("min-worker-port", RAY_WORKER_PORTS[0])), int(params.get("max-worker-port", RAY_WORKER_PORTS[1])))
        replicas = 1 if head else int(spec.get("replicas", spec.get("minReplicas", 0)))
        return cls(
            name=name,
            replicas=replicas,
            min_replicas=1 if head else int(spec.get("minReplicas", 0)),
            max_replicas=1 if head else int(spec.get("maxReplicas", replicas)),
            offers=offers,
            limits=limits,
            requests=requests,
            env={e["name"]: str(e.get("value", "")) for e in container.get("env") or [] if "value" in e},
            labels=dict(spec.get("template", {}).get("metadata", {}).get("labels") or {}),
            shm_in_memory=shm,
            reserved_ports=reserved,
            worker_ports=worker_ports,
            start_params=params,
            env_names=frozenset(e["name"] for e in container.get("env") or []),
        )


def replica_need(args: AppArgs, role: Role) -> dict[str, float]:
    """Ray resources one replica of ``role`` takes: the sum of its placement bundles, plus what the
    replica actor asks for itself (Serve adds that to the first bundle)."""
    need: Counter[str] = Counter()
    for bundle in [*placement_group_config(args, role)["bundles"], replica_actor_resources(args, role)]:
        need.update({k: float(v) for k, v in bundle.items()})
    return {k: v for k, v in need.items() if v > 0}


def replicas_per_pod(need: dict[str, float], offers: dict[str, float]) -> int:
    # Ray counts resources in units of 1/10000; compare in those units.
    return min((int(round(offers.get(k, 0.0) * 10000)) // int(round(v * 10000)) for k, v in need.items()), default=0)


def app_args_of(serve_config: dict[str, Any]) -> AppArgs:
    apps = [a for a in serve_config.get("applications") or [] if a.get("import_path") == APP_IMPORT_PATH]
    if len(apps) != 1:
        raise ValueError(f"expected one application with import_path {APP_IMPORT_PATH}, found {len(apps)}")
    return AppArgs.parse(apps[0].get("args"))


def fit_errors(manifests: list[dict[str, Any]], serve_config: dict[str, Any]) -> list[str]:
    try:
        args = app_args_of(serve_config)
    except ValueError as e:
        return [f"serve config: {e}"]
    services = [m for m in manifests if m.get("kind") == "RayService"]
    if len(services) != 1:
        return [f"expected one RayService, found {len(services)}"]
    spec = services[0].get("spec", {})
    errors = _serve_config_errors(spec, serve_config)
    cluster = spec.get("rayClusterConfig", {})
    head = Group.from_spec("head", cluster.get("headGroupSpec", {}), head=True)
    workers = [Group.from_spec(g.get("groupName", "?"), g, head=False) for g in cluster.get("workerGroupSpecs") or []]
    errors += _head_errors(head, args)
    errors += _ingress_group_errors(args, workers)
    placed: dict[Role, Group] = {}
    for role in Role:
        group, role_errors = _place(args, role, [head, *workers])
        errors += role_errors
        if group is not None:
            placed[role] = group
    if len(placed) == 2 and placed[Role.PREFILL].name == placed[Role.DECODE].name:
        errors.append(f"prefill and decode both land on worker group {placed[Role.PREFILL].name!r}")
    autoscaled = bool(cluster.get("enableInTreeAutoscaling"))
    for role, group in placed.items():
        errors += _capacity_errors(args, role, group, autoscaled)
        errors += _hardware_errors(args, role, group)
    for group in {g.name: g for g in placed.values()}.values():
        errors += _port_errors(args, [r for r, g in placed.items() if g.name == group.name], group)
    errors += _service_errors(manifests, serve_config, head)
    errors += resilience_errors(services[0], serve_config, args, head)
    return errors


def _serve_config_errors(spec: dict[str, Any], serve_config: dict[str, Any]) -> list[str]:
    text = spec.get("serveConfigV2")
    if not isinstance(text, str):
        return ["RayService spec.serveConfigV2 is missing"]
    try:
        embedded = yaml.safe_load(text)
    except yaml.YAMLError as e:
        return [f"RayService spec.serveConfigV2 is not YAML: {e}"]
    if embedded != serve_config:
        return ["RayService spec.serveConfigV2 is not the serve config (render it with deploy.render)"]
    return []


def _head_errors(head: Group, args: AppArgs) -> list[str]:
    errors = []
    ingress = args.ingress
    if ingress.on_head and head.offers.get("CPU", 0) < ingress.replicas * ingress.cpus:
        errors.append(f"head: offers {head.offers.get('CPU', 0):g} CPUs; the ingress (on_head) needs "
                      f"{ingress.replicas} x {ingress.cpus:g} there")
    if head.start_params.get("num-gpus") != "0":
        errors.append("head: rayStartParams num-gpus must be \"0\" (no engine may land on the head)")
    devices = sorted(d for d in ACCELERATOR_DEVICES if head.limits.get(d))
    if devices:
        errors.append(f"head: requests {', '.join(devices)}; the head runs no engine")
    return errors


def _ingress_group_errors(args: AppArgs, workers: list[Group]) -> list[str]:
    """``ingress.resources`` pins the ingress replicas to the worker group that offers them
    (k8s/components/ingress-group): exactly one must, with CPU for every replica."""
    keys = set(args.ingress.resources)
    if not keys:
        return []
    offering = [g for g in workers if keys <= {k for k, v in g.offers.items() if v > 0}]
    if len(offering) != 1:
        where = ", ".join(g.name for g in offering) or "no worker group"
        return [f"ingress.resources {sorted(keys)}: offered by {where}; exactly one worker group must offer them "
                "(k8s/components/ingress-group adds one)"]
    return []


def _place(args: AppArgs, role: Role, groups: list[Group]) -> tuple[Group | None, list[str]]:
    keys = set(args.role(role).resources)
    if not keys:
        return None, [f"{role.value}.resources is empty: its replicas could land on any group (the head too); "
                      f"ask for a custom resource that only the {role.value} worker group offers"]
    offering = [g for g in groups if keys & {k for k, v in g.offers.items() if v > 0}]
    if len(offering) != 1:
        where = ", ".join(g.name for g in offering) or "no group"
        return None, [f"{role.value}.resources {sorted(keys)}: offered by {where}; exactly one worker group must offer them"]
    group = offering[0]
    missing = sorted(k for k in keys if group.offers.get(k, 0) <= 0)
    if group.name == "head":
        return None, [f"{role.value}.resources {sorted(keys)}: offered by the head; engines must land on a worker group"]
    if missing:
        return None, [f"{role.value}: worker group {group.name!r} does not offer {', '.join(missing)}"]
    return group, []


def _capacity_errors(args: AppArgs, role: Role, group: Group, autoscaled: bool) -> list[str]:
    role_args = args.role(role)
    need = replica_need(args, role)
    per_pod = replicas_per_pod(need, group.offers)
    if per_pod == 0:
        short = ", ".join(f"{k} {v:g} (a pod offers {group.offers.get(k, 0):g})" for k, v in need.items() if group.offers.get(k, 0) < v)
        return [f"{role.value}: one replica does not fit one pod of group {group.name!r}: it needs {short}"]
    errors = []
    most_pods = group.max_replicas if autoscaled else group.replicas
    if per_pod * most_pods < role_args.max_replicas:
        errors.append(
            f"{role.value}: up to {role_args.max_replicas} replicas at {per_pod} per pod need "
            f"{math.ceil(role_args.max_replicas / per_pod)} pods; group {group.name!r} has at most {most_pods}"
            + ("" if autoscaled else " (enableInTreeAutoscaling is off: replicas is the most)")
        )
    if per_pod * group.replicas < role_args.min_replicas:
        errors.append(
            f"{role.value}: {role_args.min_replicas} replicas at start need "
            f"{math.ceil(role_args.min_replicas / per_pod)} pods; group {group.name!r} starts {group.replicas}"
        )
    return errors


def _hardware_errors(args: AppArgs, role: Role, group: Group) -> list[str]:
    errors = []
    where = f"{role.value} (group {group.name!r})"
    for name, amount in group.requests.items():
        # Devices and hugepages cannot be overcommitted: Kubernetes wants a limit equal to the request.
        if ("/" in name or name.startswith("hugepages-")) and group.limits.get(name) != amount:
            errors.append(f"{where}: requests {amount:g} {name} but its limit is {group.limits.get(name)}; "
                          "devices and hugepages need a limit equal to the request")
    if args.accelerator is Accelerator.GPU and group.limits.get(GPU_DEVICE, 0) < group.offers.get("GPU", 0):
        errors.append(f"{where}: Ray is told of {group.offers['GPU']:g} GPUs but the pod requests "
                      f"{group.limits.get(GPU_DEVICE, 0):g} {GPU_DEVICE}")
    devices = sorted(d for d in ACCELERATOR_DEVICES if group.limits.get(d))
    if args.accelerator is Accelerator.CPU and devices:
        errors.append(f"{where}: accelerator cpu, but the pod requests {', '.join(devices)}: the engines would "
                      "leave them idle")
    if args.accelerator is Accelerator.NEURON and not any(group.limits.get(d) for d in NEURON_DEVICES):
        errors.append(f"{where}: accelerator neuron, but the pod requests none of {', '.join(NEURON_DEVICES)}")
    if args.accelerator is not Accelerator.CPU and not group.shm_in_memory:
        errors.append(f"{where}: /dev/shm is not a memory-backed emptyDir")
    engine_env = {**group.env, **args.role(role).env}
    if "LIBFABRIC" in args.nixl.backends:
        if group.limits.get(EFA_DEVICE, 0) < 1:
            errors.append(f"{where}: NIXL backend LIBFABRIC, but the pod requests no {EFA_DEVICE}")
        if group.limits.get(HUGEPAGES, 0) <= 0:
            errors.append(f"{where}: NIXL backend LIBFABRIC, but the pod requests no {HUGEPAGES}")
        if engine_env.get("FI_PROVIDER") != "efa":
            errors.append(f"{where}: NIXL backend LIBFABRIC, but the engines' FI_PROVIDER is {engine_env.get('FI_PROVIDER')!r}, not 'efa'")
    for name, value in args.role(role).env.items():
        if name.startswith("FI_") and name in group.env and group.env[name] != value:
            errors.append(f"{where}: {name} is {value!r} in the config but {group.env[name]!r} in the pod")
    return errors


def _port_errors(args: AppArgs, roles: list[Role], group: Group) -> list[str]:
    """Every replica rank may land on any pod of the group, so check all of them together."""
    plan = args.nixl.port_plan()
    owners: dict[int, str] = {}
    errors = []
    for role in roles:
        dp = int(args.engine_kwargs_for(role).get("data_parallel_size") or 1)
        for port in plan.ports(role, args.role(role).max_replicas, dp):
            if port in owners:
                errors.append(f"group {group.name!r}: side-channel port {port} of {role.value} is also {owners[port]}'s")
            owners[port] = role.value
            if port in group.reserved_ports:
                errors.append(f"group {group.name!r}: side-channel port {port} of {role.value} is {group.reserved_ports[port]}'s")
            elif group.worker_ports[0] <= port <= group.worker_ports[1]:
                errors.append(f"group {group.name!r}: side-channel port {port} of {role.value} is in Ray's worker "
                              f"port range {group.worker_ports[0]}-{group.worker_ports[1]}")
    return errors


def _service_errors(manifests: list[dict[str, Any]], serve_config: dict[str, Any], head: Group) -> list[str]:
    http = serve_config.get("http_options") or {}
    port = int(http.get("port", 8000))
    errors = []
    if http.get("host") != "0.0.0.0":
        errors.append(f"serve config: http_options.host is {http.get('host')!r}; in a pod it must be 0.0.0.0")
    services = [m for m in manifests if m.get("kind") == "Service" and m.get("apiVersion") == "v1"]
    if not services:
        return errors + ["no Service for the OpenAI endpoint"]
    for service in services:
        name = service.get("metadata", {}).get("name")
        spec = service.get("spec", {})
        targets = [p.get("targetPort", p.get("port")) for p in spec.get("ports") or []]
        if port not in targets:
            errors.append(f"Service {name}: no port targets Serve's HTTP port {port} (targets {targets})")
        selector = spec.get("selector") or {}
        if not selector:
            errors.append(f"Service {name}: no selector")
        own = {k: v for k, v in selector.items() if not k.startswith("ray.io/")}
        if any(head.labels.get(k) != v for k, v in own.items()):
            errors.append(f"Service {name}: selector {own} does not match the head pod's labels {head.labels}")
    return errors
