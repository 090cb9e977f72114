"""The kv_transfer_params codec against what vLLM 0.29's NIXL connectors read."""

import pytest

from connector.params import (
    CONNECTOR_CLASS,
    CONNECTOR_MODULE,
    PeerIdentity,
    TransferMode,
    engine_request_id,
    new_transfer_request_id,
    pull_prefill_params,
    push_decode_params,
    push_prefill_params,
)

PEER = PeerIdentity(engine_id="prefill-r0-h-20000-abc", host="10.1.2.3", port=20000, tp_size=2, pp_size=1)


def test_push_prefill_leg_only_asks_for_remote_decode():
    assert push_prefill_params() == {"do_remote_decode": True, "do_remote_prefill": False}


def test_push_decode_leg_carries_the_prefill_identity():
    params = push_decode_params(PEER, "chatcmpl-rdv-1")
    assert params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "prefill-r0-h-20000-abc",
        "remote_host": "10.1.2.3",
        "remote_port": 20000,
        "tp_size": 2,
        "pp_size": 1,
        "remote_request_id": "chatcmpl-rdv-1",
    }


def test_pull_prefill_leg_leaves_the_address_to_prefill():
    params = pull_prefill_params()
    assert params["do_remote_decode"] is True and params["do_remote_prefill"] is False
    assert params["remote_engine_id"] is None and params["remote_block_ids"] is None


def test_peer_identity_round_trips_through_replica_metadata():
    assert PeerIdentity.from_metadata(PEER.to_metadata()) == PEER


@pytest.mark.parametrize("metadata", [None, {}, {"mori_zmq_address": "x"}])
def test_missing_peer_identity_is_a_clear_error(metadata):
    with pytest.raises(ValueError, match="published no NIXL identity"):
        PeerIdentity.from_metadata(metadata)


def test_request_ids_are_unique_and_prefixed_per_endpoint():
    ids = {new_transfer_request_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert engine_request_id("chat", "rdv-1") == "chatcmpl-rdv-1"
    assert engine_request_id("completions", "rdv-1") == "cmpl-rdv-1"


def test_connector_classes_extend_vllms_nixl_connectors():
    import importlib

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector, NixlPushConnector

    module = importlib.import_module(CONNECTOR_MODULE)
    assert issubclass(getattr(module, CONNECTOR_CLASS[TransferMode.PUSH]), NixlPushConnector)
    assert issubclass(getattr(module, CONNECTOR_CLASS[TransferMode.PULL]), NixlPullConnector)
