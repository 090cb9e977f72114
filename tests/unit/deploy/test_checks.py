"""deploy/checks.py: its pure parts, on literal input (tests/unit/test_k8s.py runs fit_errors on the
rendered manifests and every deploy config)."""

from __future__ import annotations

import math

import pytest

from app.config.args import AppArgs
from connector.ports import Role
from deploy.checks import Group, parse_quantity, ray_start_resources


def test_two_roles_sharing_a_pod_would_still_get_distinct_ports():
    """Roles on one group are refused anyway; even then the port plan keeps them apart."""
    from deploy.checks import _port_errors

    args = AppArgs.parse({"prefill": {"replicas": 3}, "decode": {"replicas": 3}})
    group = Group.from_spec("g", {"replicas": 1, "template": {"spec": {"containers": [{}]}}}, head=False)
    assert _port_errors(args, list(Role), group) == []
    plan = args.nixl.port_plan()
    assert not set(plan.ports(Role.PREFILL, 3)) & set(plan.ports(Role.DECODE, 3))


@pytest.mark.parametrize("value, number", [("8", 8), (8, 8), ("500m", 0.5), ("64Gi", 64 * 2**30), ("5120Mi", 5120 * 2**20), ("1e3", 1000)])
def test_parse_quantity(value, number):
    assert math.isclose(parse_quantity(value), number)


@pytest.mark.parametrize("value, parsed", [
    ('"{\\"prefill_group\\": 100}"', {"prefill_group": 100.0}),
    ('{"a": 1, "neuron_cores": 64}', {"a": 1.0, "neuron_cores": 64.0}),
    (None, {}),
])
def test_ray_start_resources(value, parsed):
    assert ray_start_resources(value) == parsed
