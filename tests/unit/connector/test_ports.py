import pytest

from connector.ports import PortPlan, Role, make_engine_id


@pytest.mark.parametrize(
    "role, rank, dp, expected",
    [
        (Role.PREFILL, 0, 1, 20000),
        (Role.PREFILL, 3, 1, 20003),
        (Role.DECODE, 0, 1, 22000),
        (Role.DECODE, 2, 4, 22008),  # DP ranks of replica 2 use 22008..22011
    ],
)
def test_port_for_role_rank_and_dp(role, rank, dp, expected):
    assert PortPlan().port(role, rank, dp) == expected


def test_ports_of_all_replicas_never_collide():
    plan = PortPlan()
    used = set()
    for role in Role:
        for rank in range(8):
            for dp in range(2):
                used.add(plan.port(role, rank, 2) + dp)
    assert len(used) == 2 * 8 * 2


def test_rank_beyond_span_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        PortPlan().port(Role.PREFILL, 2000)
    with pytest.raises(ValueError, match="does not fit"):
        PortPlan().check_fits(Role.DECODE, replicas=1001, dp_size=2)


@pytest.mark.parametrize("prefill, decode", [(20000, 20500), (22000, 21000), (100, 5000), (64000, 20000)])
def test_bad_bases_are_refused(prefill, decode):
    with pytest.raises(ValueError):
        PortPlan(prefill_base=prefill, decode_base=decode)


def test_engine_id_is_readable_and_changes_per_start():
    a = make_engine_id(Role.PREFILL, 1, "10.0.0.5", 20001)
    b = make_engine_id(Role.PREFILL, 1, "10.0.0.5", 20001)
    assert a.startswith("prefill-r1-10.0.0.5-20001-") and a != b
    assert make_engine_id(Role.DECODE, 0, "h", 1, nonce="x") == "decode-r0-h-1-x"


def test_a_replica_tries_its_ranks_block_first_then_every_other_block_of_its_role():
    """Serve's ranks are not stable across scaling: a new replica can be given the rank whose port a live one binds."""
    plan = PortPlan()
    candidates = plan.candidates(Role.DECODE, 1, dp_size=2)
    assert candidates[:3] == [22002, 22000, 22004]
    assert len(candidates) == plan.span // 2 and len(set(candidates)) == len(candidates)
    assert all(plan.decode_base <= c < plan.decode_base + plan.span for c in candidates)
