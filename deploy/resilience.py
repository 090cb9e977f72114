"""Does the RayService survive a head restart and roll the way this app needs? (pure)

``resilience_errors(service, serve_config, args, head)`` returns one line per problem, as
``deploy.checks.fit_errors`` (which calls it) does.

With GCS fault tolerance (``rayClusterConfig.gcsFaultToleranceOptions``) the head keeps the cluster's
state in Redis, and worker pods, with the engines and replicas on them, outlive a head restart. The
app keeps answering through one only if nothing on the path of a request lives on the head:

* the ingress replicas run on the workers: ``ingress.on_head`` false, and the head offers Ray no CPU
  (else Ray may still place them there);
* every node runs a proxy (``proxy_location: EveryNode``) and no Service sends clients to the head's
  (``excludeHeadPodFromServeSvc``);
* the Redis password comes from a Secret, over TLS (``rediss://``), and no ``externalStorageNamespace``
  is set: KubeRay then keys each RayCluster by its UID, so the old and the new cluster of a
  NewCluster upgrade never share one namespace in Redis;
* nothing KubeRay refuses beside ``gcsFaultToleranceOptions`` (its ValidateRayClusterSpec): a
  ``redis-password`` start parameter, ``REDIS_PASSWORD`` / ``RAY_REDIS_ADDRESS`` on the head, the
  older annotations.

The upgrade strategy must be set, to a type KubeRay accepts: the CRD's schema has no enum for it
(KubeRay's controller refuses other values), and unset it follows the operator's ENABLE_ZERO_DOWNTIME.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # deploy.checks imports this module
    from app.config.args import AppArgs
    from deploy.checks import Group

# KubeRay's ValidateRayServiceSpec (RayServiceUpgradeType); the incremental one needs a feature gate.
UPGRADE_TYPES = ("NewCluster", "NewClusterWithIncrementalUpgrade", "None")
INCREMENTAL = "NewClusterWithIncrementalUpgrade"
EVERY_NODE = "EveryNode"  # Ray Serve's default proxy_location
# Ray's accepted forms (ray._private.services.get_address): host:port, redis://host:port, rediss://host:port.
_REDIS_ADDRESS = re.compile(r"^(?:(?P<scheme>rediss?)://)?(?P<host>[A-Za-z0-9.-]+):(?P<port>\d{1,5})$")
_OLD_FT_ANNOTATIONS = ("ray.io/ft-enabled", "ray.io/external-storage-namespace")


def resilience_errors(service: dict[str, Any], serve_config: dict[str, Any], args: AppArgs, head: Group) -> list[str]:
    spec = service.get("spec", {})
    errors = upgrade_errors(spec)
    options = spec.get("rayClusterConfig", {}).get("gcsFaultToleranceOptions")
    if options is not None:
        errors += _redis_errors(options)
        errors += _kuberay_errors(service, head)
        errors += _head_restart_errors(spec, serve_config, args, head)
    return errors


def upgrade_errors(spec: dict[str, Any]) -> list[str]:
    """KubeRay's rules for ``spec.upgradeStrategy``, plus: it is set."""
    strategy = spec.get("upgradeStrategy") or {}
    kind = strategy.get("type")
    errors = []
    if kind is None:
        errors.append(f"RayService spec.upgradeStrategy.type is unset: set one of {', '.join(UPGRADE_TYPES)} "
                      "(unset, the KubeRay operator's ENABLE_ZERO_DOWNTIME decides)")
    elif kind not in UPGRADE_TYPES:
        errors.append(f"RayService spec.upgradeStrategy.type {kind!r}: KubeRay accepts {', '.join(UPGRADE_TYPES)}")
    if (spec.get("rayClusterConfig", {}).get("upgradeStrategy") or {}).get("type") is not None:
        errors.append("rayClusterConfig.upgradeStrategy is the RayCluster's own (Recreate, None): KubeRay refuses it "
                      "on a cluster a RayService creates; use spec.upgradeStrategy")
    if kind == INCREMENTAL:
        errors += _incremental_errors(spec, strategy.get("clusterUpgradeOptions"))
    return errors


def _incremental_errors(spec: dict[str, Any], options: dict[str, Any] | None) -> list[str]:
    where = f"upgradeStrategy {INCREMENTAL}"
    if not spec.get("rayClusterConfig", {}).get("enableInTreeAutoscaling"):
        return [f"{where} needs Ray's autoscaler (enableInTreeAutoscaling)"]
    if not options:
        return [f"{where} needs clusterUpgradeOptions"]
    surge, step, interval = options.get("maxSurgePercent", 100), options.get("stepSizePercent"), options.get("intervalSeconds")
    errors = []
    if not options.get("gatewayClassName"):
        errors.append(f"{where}: clusterUpgradeOptions.gatewayClassName is required")
    if not 0 <= surge <= 100:
        errors.append(f"{where}: maxSurgePercent {surge} is not within 0-100")
    if step is None or not 0 <= step <= min(100, surge):
        errors.append(f"{where}: stepSizePercent {step} must be within 0 and maxSurgePercent ({surge})")
    if interval is None or interval <= 0:
        errors.append(f"{where}: intervalSeconds {interval} must be above 0")
    return errors


def _redis_errors(options: dict[str, Any]) -> list[str]:
    where = "gcsFaultToleranceOptions"
    if options.get("backend", "redis") != "redis":
        return [f"{where}.backend {options['backend']!r}: only the Redis backend is set up and documented here"]
    errors = []
    address = str(options.get("redisAddress") or "")
    match = _REDIS_ADDRESS.match(address)
    if match is None:
        errors.append(f"{where}.redisAddress {address!r}: Ray takes host:port, redis://host:port or rediss://host:port")
    elif match["scheme"] != "rediss":
        errors.append(f"{where}.redisAddress {address!r}: not rediss:// (TLS); the password would cross the network "
                      "in clear, and ElastiCache with an AUTH token only speaks TLS")
    password = options.get("redisPassword") or {}
    ref = (password.get("valueFrom") or {}).get("secretKeyRef") or {}
    if "value" in password or set(password.get("valueFrom") or {}) - {"secretKeyRef"}:
        errors.append(f"{where}.redisPassword: a literal or non-Secret source; take it from a Secret (valueFrom.secretKeyRef)")
    elif not (ref.get("name") and ref.get("key")):
        errors.append(f"{where}.redisPassword: no valueFrom.secretKeyRef with a name and key")
    if options.get("externalStorageNamespace"):
        errors.append(f"{where}.externalStorageNamespace is set: the old and the new RayCluster of a NewCluster "
                      "upgrade would share it in Redis; leave it unset (KubeRay uses each cluster's UID)")
    return errors


def _kuberay_errors(service: dict[str, Any], head: Group) -> list[str]:
    """What KubeRay's ValidateRayClusterSpec refuses beside gcsFaultToleranceOptions."""
    errors = []
    annotations = service.get("metadata", {}).get("annotations") or {}
    errors += [f"RayService annotation {a}: KubeRay refuses it with gcsFaultToleranceOptions" for a in _OLD_FT_ANNOTATIONS if a in annotations]
    if "redis-password" in head.start_params:
        errors.append("head: rayStartParams redis-password; KubeRay refuses it with gcsFaultToleranceOptions.redisPassword")
    errors += [f"head: env {name}; KubeRay refuses it with gcsFaultToleranceOptions" for name in ("REDIS_PASSWORD", "RAY_REDIS_ADDRESS")
               if name in head.env_names]
    return errors


def _head_restart_errors(spec: dict[str, Any], serve_config: dict[str, Any], args: AppArgs, head: Group) -> list[str]:
    errors = serve_head_restart_errors(serve_config, args)
    if head.offers.get("CPU", 0) > 0:
        errors.append(f"GCS fault tolerance: the head offers Ray {head.offers['CPU']:g} CPUs, so the ingress may still "
                      "land there; set its rayStartParams num-cpus to \"0\"")
    if not spec.get("excludeHeadPodFromServeSvc"):
        errors.append("GCS fault tolerance: excludeHeadPodFromServeSvc is not true, so clients reach the head's proxy "
                      "and a head restart cuts their connections")
    return errors


def serve_head_restart_errors(serve_config: dict[str, Any], args: AppArgs) -> list[str]:
    """What in a serve config puts a request's path on the head (Kubernetes, and ``app.tools.cluster up --gcs-ft``)."""
    errors = []
    if args.ingress.on_head:
        errors.append("GCS fault tolerance: ingress.on_head is true, so a head restart still takes the ingress and every "
                      "stream it carries; set it false")
    location = serve_config.get("proxy_location", EVERY_NODE)
    if location != EVERY_NODE:
        errors.append(f"GCS fault tolerance: proxy_location {location!r}; only {EVERY_NODE} runs proxies on the workers, "
                      "which keep serving while the head restarts")
    return errors
