"""Conversations: the retention table, what the router and ingress do with an id, and the
engine-side reuse decisions (pure parts; the real thing runs in tests/integration)."""

from __future__ import annotations

import types

import pytest

from app.request.envelope import CONVERSATION_ID_PATTERN, TurnReason
from app.routing.conversations import ConversationTable, continues_a_conversation
from app.routing.pipeline import ReplicaSnapshot, RouteRequest, RoutingPolicy, pick
from connector.params import ReuseReport
from tests.support.routing import serve_router


# --------------------------------------------------------------------------- retention table


def test_a_conversation_is_reused_within_retention_and_gets_a_new_salt_after_it():
    table = ConversationTable(retention_s=10)
    first = table.begin("c", now=0, continuation=False)
    assert (first.reuse, first.reason) == (False, TurnReason.FIRST_TURN)
    table.end(first, now=1)
    second = table.begin("c", now=10.9, continuation=True)
    assert (second.reuse, second.reason, second.cache_salt) == (True, TurnReason.ATTEMPT, first.cache_salt)
    table.end(second, now=11)
    late = table.begin("c", now=21.5, continuation=True)
    assert (late.reuse, late.reason) == (False, TurnReason.EXPIRED)
    assert late.cache_salt != first.cache_salt  # the expired KV can never be reached again


def test_a_turn_in_flight_never_expires_and_concurrent_turns_share_the_salt():
    table = ConversationTable(retention_s=1)
    a = table.begin("c", now=0, continuation=False)
    b = table.begin("c", now=100, continuation=True)  # a is still running
    assert b.reuse and b.cache_salt == a.cache_salt
    table.end(a, now=101)
    assert table.held(now=150) == ["c"]  # b still running
    table.end(b, now=150)
    assert table.held(now=150.5) == ["c"] and table.held(now=151.5) == []
    assert table.known(limit=10) == ["c"]  # still published: its next turn comes here and is told it expired


def test_a_continuation_this_replica_never_held_is_reported_as_replica_gone():
    turn = ConversationTable(retention_s=10).begin("c", now=0, continuation=True)
    assert (turn.reuse, turn.reason) == (False, TurnReason.REPLICA_GONE)


def test_conversations_are_isolated_and_bounded():
    table = ConversationTable(retention_s=10, max_conversations=2)
    salts = {cid: table.begin(cid, now=i, continuation=False).cache_salt for i, cid in enumerate("abc")}
    assert len(set(salts.values())) == 3
    assert table.held(now=5) == table.known(limit=5) == ["b", "c"]  # the least recently used one was dropped
    assert table.known(limit=1) == ["c"]


@pytest.mark.parametrize(
    "messages, continues",
    [
        ([{"role": "user", "content": "hi"}], False),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "?"}], True),
    ],
)
def test_an_earlier_assistant_turn_marks_a_continuation(messages, continues):
    assert continues_a_conversation(types.SimpleNamespace(messages=messages)) is continues
    assert continues_a_conversation(types.SimpleNamespace(prompt="x")) is False


@pytest.mark.parametrize("value, ok", [("c-1", True), ("a.b:c@d_e", True), ("x" * 128, True), ("x" * 129, False), ("", False), ("a b", False), ("ü", False)])
def test_conversation_id_charset_and_length(value, ok):
    assert bool(CONVERSATION_ID_PATTERN.fullmatch(value)) is ok


# --------------------------------------------------------------------------- routing


def test_the_holder_wins_over_a_less_loaded_replica_unless_filtered_out():
    policy = RoutingPolicy()
    holder = ReplicaSnapshot("busy", ongoing_requests=6, tokens_in_flight=6000, holds_conversation=True, stats_age_s=0)
    idle = ReplicaSnapshot("idle", stats_age_s=0)
    assert pick(policy, RouteRequest(conversation_id="c"), [holder, idle]).replica_id == "busy"
    assert pick(policy, RouteRequest(), [holder, idle]).replica_id == "idle"  # no id: load decides
    full = ReplicaSnapshot("busy", kv_usage=0.99, holds_conversation=True, stats_age_s=0)
    assert pick(policy, RouteRequest(conversation_id="c"), [full, idle]).replica_id == "idle"


def test_the_router_reads_the_conversation_from_the_header_and_learns_holders():
    from app.routing.decode_router import LoadAwareDecodeRouter, conversation_of
    from app.routing.pipeline import STATS_KEY

    raw = types.SimpleNamespace(headers={"x-conversation-id": "c"})
    assert conversation_of(types.SimpleNamespace(args=("body", raw))) == "c"
    assert conversation_of(types.SimpleNamespace(args=("body",))) is None
    assert conversation_of(None) is None

    router = serve_router(LoadAwareDecodeRouter)
    published = types.SimpleNamespace(routing_stats={STATS_KEY: {"recorded_at": 1.0, "conversations": ["c"]}})
    silent = types.SimpleNamespace(routing_stats={})
    assert router._holders("c", {"a": published, "b": silent}, now=2.0) == {"a"}
    router._picked["d"] = ("b", 1.0)  # this router sent "d" to b a moment ago
    assert router._holders("d", {"a": published, "b": silent}, now=2.0) == {"b"}
    assert router._holders("d", {"a": published}, now=2.0) == set()  # b is gone


# --------------------------------------------------------------------------- engine-side decisions


@pytest.mark.parametrize(
    "offered, prompt, block, want",
    [(512, 700, 128, 512), (512, 513, 128, 512), (512, 512, 128, 384), (0, 700, 128, 0), (1024, 300, 128, 256), (100, 700, 16, 100)],
)
def test_reuse_is_whole_blocks_and_never_the_last_prompt_token(offered, prompt, block, want):
    from connector.params import reusable_tokens

    assert reusable_tokens(offered, prompt, block) == want


def _prefill_scheduler(threshold: int = 64, single_group: bool = True):
    from connector.push_reuse import ReuseScheduler

    model = types.SimpleNamespace(dtype=types.SimpleNamespace(itemsize=1), get_total_num_hidden_layers=lambda: 5,
                                  get_total_num_kv_heads=lambda: 1, get_head_size=lambda: 1)  # 10 bytes a token
    host = types.SimpleNamespace(  # what ReuseScheduler reads of vLLM's push scheduler
        block_size=128, kv_recompute_threshold=threshold,
        kv_cache_config=types.SimpleNamespace(kv_cache_groups=[None] * (1 if single_group else 2)),
        vllm_config=types.SimpleNamespace(model_config=model, cache_config=types.SimpleNamespace(cache_dtype="auto")))
    return ReuseScheduler(host)


def _request(prompt_tokens: int = 700):
    from connector.params import REUSE_KEY

    return types.SimpleNamespace(
        request_id="cmpl-rdv-1", num_prompt_tokens=prompt_tokens, kv_transfer_params={"do_remote_decode": True, REUSE_KEY: True}
    )


def _offer(tokens: int, blocks: int = 2):
    return {"block_ids": list(range(tokens // 128)), "num_tokens": tokens, "engine_id": "d", "host": "h", "port": 1, "tp_size": 1, "registered_blocks": blocks}


def test_prefill_waits_for_the_offer_then_loads_the_verified_prefix():
    from connector.push_reuse import HISTORY_READ_ID

    scheduler, request = _prefill_scheduler(), _request()
    assert scheduler.matched_tokens(request, 0) == (None, False)  # asked again next step
    scheduler._offers["cmpl-rdv-1"] = (0.0, _offer(512))
    assert scheduler.matched_tokens(request, 0) == (512, True)
    params = request.kv_transfer_params
    assert params["remote_block_ids"] == [[0, 1, 2, 3]] and params["remote_request_id"] == HISTORY_READ_ID
    assert scheduler.matched_tokens(request, 0) == (512, True)  # asked again after a failed allocation
    assert scheduler._reports["cmpl-rdv-1"] == ReuseReport("reused", reused_tokens=512, pushed_tokens=256, kv_bytes_per_token=10)


@pytest.mark.parametrize(
    "offered, computed, reason",
    [(0, 0, "no_match"), (128, 100, "threshold")],
)
def test_prefill_recomputes_when_reuse_is_not_worth_it(offered, computed, reason):
    scheduler, request = _prefill_scheduler(), _request()
    scheduler._offers["cmpl-rdv-1"] = (0.0, _offer(offered))
    assert scheduler.matched_tokens(request, computed) == (0, False)
    assert scheduler._reports["cmpl-rdv-1"].reason == reason


def test_prefill_stops_waiting_for_an_offer_that_does_not_come(monkeypatch):
    from connector import push_reuse

    scheduler, request = _prefill_scheduler(), _request()
    now = [0.0]
    monkeypatch.setattr(push_reuse.time, "monotonic", lambda: now[0])
    assert scheduler.matched_tokens(request, 0) == (None, False)
    now[0] = push_reuse.REUSE_OFFER_WAIT_S + 1
    assert scheduler.matched_tokens(request, 0) == (0, False)
    assert scheduler._reports["cmpl-rdv-1"].reason == "no_offer"


def test_offers_from_several_workers_merge():
    from connector.push_reuse import ReuseOffers

    assert ReuseOffers({"a": {}}).aggregate(ReuseOffers({"b": {}})).offers.keys() == {"a", "b"}
    assert ReuseOffers(mismatched={"r1"}).aggregate(ReuseOffers(mismatched={"r2"})).mismatched == {"r1", "r2"}


def test_a_history_read_that_landed_wrong_is_reported_as_such():
    """connector.kv_checksum found the READ's KV wrong: prefill recomputed the history, and says so."""
    from connector.push_reuse import ReuseOffers

    scheduler, request = _prefill_scheduler(), _request()
    scheduler._offers["cmpl-rdv-1"] = (0.0, _offer(512))
    assert scheduler.matched_tokens(request, 0) == (512, True)
    scheduler.output(types.SimpleNamespace(kv_connector_worker_meta=ReuseOffers(mismatched={"cmpl-rdv-1", "gone"}),
                                                      finished_recving=set(), finished_sending=set()))
    assert scheduler._reports["cmpl-rdv-1"] == ReuseReport("kv_mismatch", reused_tokens=0, pushed_tokens=256,
                                                           kv_bytes_per_token=10)


def test_a_turn_knows_how_much_history_its_replica_holds():
    table = ConversationTable(retention_s=10)
    first = table.begin("c", now=0, continuation=False)
    assert first.held_tokens == 0
    table.end(first, now=1, prompt_tokens=900)
    assert table.begin("c", now=2, continuation=True).held_tokens == 900


@pytest.mark.parametrize("new_user_tokens, path", [(10, "local"), (200, "remote")])
def test_a_short_new_turn_is_prefilled_by_decode_from_the_history_it_holds(new_user_tokens, path):
    """routing.local_prefill_below_tokens counts what would have to be computed."""
    import asyncio

    from ray.llm._internal.serve.core.configs.openai_api_models import ChatCompletionRequest

    from tests.support.decode_server import decode_server

    async def local(endpoint, request, raw=None):
        async def gen():
            yield "local"
        return gen()

    server = decode_server(local_below=64, conversations=types.SimpleNamespace(retention_s=100, recompute_threshold=64),
                           engine=local)
    prompts = iter([900, 900 + new_user_tokens])
    server._prompt_token_ids = lambda request: [0] * next(prompts)

    async def remote(request, raw, endpoint, served, history=None, keep=False, hand_off=False):
        yield "remote"

    server._handoff.remote_or_fallback = remote
    raw = types.SimpleNamespace(headers={"x-conversation-id": "c"})
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])

    async def two_turns():
        for _ in range(2):
            [chunk async for chunk in await server.chat(request, raw)]

    asyncio.run(two_turns())
    assert server.paths == ["remote", path]


# --------------------------------------------------------------------------- pull: vLLM's own read-back


def test_decode_keeps_blocks_only_for_the_turns_that_ask(monkeypatch):
    """With bidirectional_kv_xfer vLLM keeps every finished decode request's blocks; ours
    only those of the turns the orchestrator marks (prefill's side is upstream's)."""
    from connector.params import KEEP_HISTORY_KEY
    from connector.pull_history import HistoryPullScheduler

    host = types.SimpleNamespace(is_bidirectional_kv_xfer_enabled=True)  # vLLM's pull scheduler, as far as it matters
    scheduler = HistoryPullScheduler(host)

    def keeps(params) -> bool:
        """What upstream's request_finished decides on, inside ours: keep for a read-back or not."""
        with scheduler.finishing(types.SimpleNamespace(kv_transfer_params=params)):
            return host.is_bidirectional_kv_xfer_enabled

    assert not keeps({"do_remote_prefill": True})  # a one-off request, or a streamed turn
    assert keeps({"do_remote_prefill": True, KEEP_HISTORY_KEY: True})
    assert keeps({"do_remote_decode": True})  # prefill: as upstream
    assert host.is_bidirectional_kv_xfer_enabled
    host.is_bidirectional_kv_xfer_enabled = False
    assert not keeps({"do_remote_prefill": True, KEEP_HISTORY_KEY: True})


def _pull_turns():
    from app.routing.planner import PlanSettings
    from app.decode.turns import TurnBook
    from connector.params import TransferMode

    settings = PlanSettings(TransferMode.PULL, 0, False, upstream_history=True, isolate_uncached=False)
    return TurnBook(ConversationTable(retention_s=100), settings, metrics=None, recompute_threshold=64,
                    block_size=lambda: 16, kv_bytes_per_token=lambda: 1000)


HISTORY = list(range(200))
OFFER = {"do_remote_decode": True, "do_remote_prefill": False, "remote_block_ids": [list(range(100, 114))], "remote_num_tokens": 220}


@pytest.mark.parametrize(
    "kept, prompt, reason, reused",
    [
        (None, HISTORY + [1, 2], "no_offer", 0),  # e.g. the last turn was streamed
        (HISTORY, HISTORY + [1, 2], "reused", 192),
        (HISTORY, [7] + HISTORY, "no_match", 0),  # re-rendered from the first token
        (HISTORY, HISTORY[:50] + [0] * 150, "threshold", 0),  # 48 verified < 64
    ],
)
def test_pull_reads_back_only_the_verified_history(kept, prompt, reason, reused):
    from app.decode.turns import KeptHistory

    turns = _pull_turns()
    table = turns.table
    table.end(table.begin("c", now=0, continuation=False), now=1)
    if kept is not None:
        turns._kept["c"] = KeptHistory(OFFER, kept, kept_at=1)
    turn = table.begin("c", now=2, continuation=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("app.decode.turns.time.time", lambda: 2.0)
        params = turns.read_back(turn, "rdv-2", prompt)
    report = turns.report("rdv-2")
    assert (report.reason, report.reused_tokens, report.kv_bytes_per_token) == (reason, reused, 1000)
    if reason == "reused":
        assert params["remote_num_tokens"] == 192 and params["remote_block_ids"] == [list(range(100, 112))]
    else:
        assert params is None
    assert "c" not in turns._kept  # each kept turn is read back once at most


def test_an_expired_conversation_reads_nothing_back_and_its_kept_blocks_are_forgotten():
    from app.decode.turns import KeptHistory

    turns = _pull_turns()
    table = turns.table
    table.end(table.begin("c", now=0, continuation=False), now=1)
    turns._kept["c"] = KeptHistory(OFFER, HISTORY, kept_at=1)
    turns._kept["abandoned"] = KeptHistory(OFFER, HISTORY, kept_at=1)
    turn = table.begin("c", now=500, continuation=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("app.decode.turns.time.time", lambda: 500.0)
        assert turns.read_back(turn, "rdv-2", HISTORY + [1]) is None
    assert not turn.reuse and turns._kept == {} and turns.report("rdv-2") is None


def test_a_pulled_history_comes_with_decodes_sums_and_a_read_that_landed_wrong_ends_the_turn_as_kv_mismatch():
    from app.decode.turns import KeptHistory
    from connector.params import KV_SUMS_KEY, REUSE_REPORT_KEY, ReuseReport

    turns = _pull_turns()
    table = turns.table
    table.end(table.begin("c", now=0, continuation=False), now=1)
    turns._kept["c"] = KeptHistory({**OFFER, KV_SUMS_KEY: {"tp": 1}}, HISTORY, kept_at=1)
    turn = table.begin("c", now=2, continuation=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("app.decode.turns.time.time", lambda: 2.0)
        params = turns.read_back(turn, "rdv-2", HISTORY + [1, 2])
    assert params[KV_SUMS_KEY] == {"tp": 1}  # prefill's workers check its READ against them (connector.pull_checksum)
    turns.prefill_reported("rdv-2", {REUSE_REPORT_KEY: ReuseReport("kv_mismatch").to_wire()})
    assert (turns.report("rdv-2").reason, turns.report("rdv-2").reused_tokens) == ("kv_mismatch", 0)


def test_a_prefill_leg_whose_history_read_failed_recomputes_instead_of_waiting_for_it_forever():
    """Upstream asks for the history READ again once the leg's tokens fall back to zero (a READ
    that failed or landed wrong is recomputed from the first block), but plans one READ per leg:
    the request would wait for KV that never comes. Ours asks once (connector.pull_history)."""
    from connector.params import READ_PLANNED_KEY
    from connector.pull_history import HistoryPullScheduler

    scheduler = HistoryPullScheduler(types.SimpleNamespace(is_bidirectional_kv_xfer_enabled=True))
    params = {**OFFER, "remote_engine_id": "d", "remote_request_id": "r", "remote_host": "h", "remote_port": 1}
    request = types.SimpleNamespace(request_id="p", kv_transfer_params=params)
    assert not scheduler.read_tried(request)  # upstream plans the READ (connector.pull_connector asks it)
    params[READ_PLANNED_KEY] = True  # what upstream's update_state_after_alloc sets once it planned the READ
    assert scheduler.read_tried(request)  # asked again: 0 tokens, the leg recomputes its history
