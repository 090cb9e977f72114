"""connector.settings: our kv_connector_extra_config keys, parsed once, unknown ones refused."""

from __future__ import annotations

import pytest

from connector.settings import DEFAULTS, ConnectorSettings, backends


@pytest.mark.parametrize("extra, expected", [
    (None, ConnectorSettings()),
    ({}, DEFAULTS),
    ({"rendezvous_kv_timeout_s": 25, "rendezvous_kv_checksums": False},
     ConnectorSettings(kv_timeout_s=25.0, kv_checksums=False)),
    ({"rendezvous_kv_peer_tp_size": 3, "backends": ["LIBFABRIC"], "kv_lease_duration": 30},  # vLLM's keys: vLLM's
     ConnectorSettings(kv_peer_tp_size=3)),
])
def test_our_keys_are_read_and_vllms_left_to_vllm(extra, expected):
    assert ConnectorSettings.parse(extra) == expected


@pytest.mark.parametrize("extra, says", [
    ({"rendezvous_kv_checksum": False}, "unknown kv_connector_extra_config key(s) ['rendezvous_kv_checksum']; ours are "
                                        "['rendezvous_kv_timeout_s', 'rendezvous_kv_checksums', 'rendezvous_progressive', 'rendezvous_kv_peer_tp_size']"),
    ({"rendezvous_kv_timeout_s": -1}, "kv_timeout_s"),
    ({"rendezvous_kv_peer_tp_size": "two"}, "kv_peer_tp_size"),
])
def test_a_misspelt_or_invalid_key_is_refused_by_name(extra, says):
    with pytest.raises(ValueError) as refused:
        ConnectorSettings.parse(extra)
    assert says in str(refused.value)


def test_what_the_app_writes_is_what_the_connector_reads():
    settings = ConnectorSettings(kv_timeout_s=7.5, kv_checksums=False, kv_peer_tp_size=2)
    assert ConnectorSettings.parse(settings.extra()) == settings
    assert "rendezvous_kv_timeout_s" not in ConnectorSettings().extra()  # None: no deadline, nothing written


def test_the_backends_are_vllms_default_unless_set():
    assert backends(None) == backends({}) == ["UCX"]
    assert backends({"backends": ["LIBFABRIC"]}) == ["LIBFABRIC"]


def test_the_app_refuses_our_keys_in_nixl_extra_config_and_writes_the_rest_the_connectors_read():
    from app.config.args import AppArgs
    from app.config.llm_configs import kv_transfer_config
    from connector.ports import Role

    with pytest.raises(ValueError, match=r"nixl.extra_config \['rendezvous_kv_checksums'\]: .* handoff"):
        AppArgs.parse({"nixl": {"extra_config": {"rendezvous_kv_checksums": False}}})
    args = AppArgs.parse({"mode": "pull", "handoff": {"kv_checksums": False},
                          "prefill": {"engine_kwargs": {"tensor_parallel_size": 3}}})
    extra = kv_transfer_config(args, Role.DECODE)["kv_connector_extra_config"]
    assert ConnectorSettings.parse(extra) == ConnectorSettings(
        kv_timeout_s=args.handoff.read_timeout_s, kv_checksums=False, kv_peer_tp_size=3)
