"""The kv_transfer_params codec against what vLLM 0.29's NIXL connectors read."""

import pytest

from connector.params import (
    CONNECTOR_CLASS,
    CONNECTOR_MODULE,
    PeerIdentity,
    TransferMode,
    engine_request_id,
    new_transfer_request_id,
    pull_history_params,
    pull_prefill_params,
    push_decode_params,
    push_prefill_params,
    verified_history_tokens,
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


# Pull mode, conversations.pull_history = upstream: decode's previous turn's
# kv_transfer_params (vLLM's bidirectional_kv_xfer) as prefill's next leg reads them.
OFFER = {
    "do_remote_prefill": False, "do_remote_decode": True, "remote_block_ids": [[7, 3, 9, 4]],
    "remote_engine_id": "decode-r0-h-22000-abc", "remote_request_id": "chatcmpl-rdv-1", "remote_host": "10.1.2.4",
    "remote_port": 22000, "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 61,
    "remote_blocks_expiry_time": 123.0, "transfer_mode": "pull",
}


def test_history_read_back_is_cut_to_the_verified_whole_blocks():
    params = pull_history_params(OFFER, tokens=40, block_size=16)
    # The worker pairs local and remote blocks from the end: the list must end at the prefix.
    assert params["remote_block_ids"] == [[7, 3]] and params["remote_num_tokens"] == 32
    assert params["do_remote_decode"] is True and params["do_remote_prefill"] is False
    assert {k: params[k] for k in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")} == {
        k: OFFER[k] for k in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")
    }
    assert OFFER["remote_block_ids"] == [[7, 3, 9, 4]]  # the offer itself is left alone


@pytest.mark.parametrize(
    "held, prompt, want",
    [
        (list(range(100)), list(range(100)) + [5, 6], 96),  # all held, whole blocks
        (list(range(100)), list(range(40)) + [0] * 60, 32),  # edited at token 40
        (list(range(100)), list(range(33)), 32),  # never the last prompt token
        (list(range(10)), list(range(50)), 0),  # less than a block matches
        ([], list(range(50)), 0),
    ],
)
def test_verified_history_is_the_block_aligned_common_prefix(held, prompt, want):
    assert verified_history_tokens(held, prompt, block_size=16) == want


def test_kv_bytes_per_token_counts_k_and_v_of_every_layer_and_every_kv_head():
    from types import SimpleNamespace

    import torch

    from connector.params import kv_bytes_per_token

    def config(dtype, cache_dtype="auto"):
        model = SimpleNamespace(dtype=dtype, get_total_num_hidden_layers=lambda: 30, get_total_num_kv_heads=lambda: 3,
                                get_head_size=lambda: 64)
        return SimpleNamespace(model_config=model, cache_config=SimpleNamespace(cache_dtype=cache_dtype))

    # SmolLM2-135M: 30 layers x 3 KV heads x 64 dims, K and V.
    assert kv_bytes_per_token(config(torch.float32)) == 2 * 30 * 3 * 64 * 4 == 46080
    assert kv_bytes_per_token(config(torch.bfloat16)) == 23040
    assert kv_bytes_per_token(config(torch.bfloat16, "fp8_e4m3")) == 11520
