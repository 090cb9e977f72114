"""Per-request timelines (app.request.timeline): stages from stamps, the decode replica's part of
the stream, the ingress completing them, and the prefill engine's own stamps."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest
from ray.llm._internal.serve.core.configs.openai_api_models import CompletionRequest

from app.request.timeline import LOG_MARKER, STAGES, RequestTimeline
from connector.params import STAGES_KEY
from connector.stages import DecodeKvStamps

REMOTE = {
    "arrived": 100.0, "decode_received": 100.01, "legs_sent": 100.03, "prefill_queued": 100.04,
    "prefill_started": 100.1, "prefill_finished": 102.1, "prefill_answered": 102.12, "first_token": 102.3,
    "first_chunk": 102.31,
}


@pytest.mark.parametrize(
    "route, stamps, expected",
    [
        ("remote", REMOTE, {"route": 0.01, "bind": 0.02, "prefill_hop": 0.01, "prefill_queue": 0.06,
                            "prefill_compute": 2.0, "handoff": 0.2, "deliver": 0.01, "ttft": 2.31}),
        ("local", {"arrived": 1.0, "decode_received": 1.1, "first_token": 1.6, "first_chunk": 1.7},
         {"route": 0.1, "local_prefill": 0.5, "deliver": 0.1, "ttft": 0.7}),
        # Fallback: the prefill leg went out, then decode prefilled it itself.
        ("fallback", {"arrived": 1.0, "decode_received": 1.1, "legs_sent": 1.2, "first_token": 31.5, "first_chunk": 31.6},
         {"route": 0.1, "local_prefill": 30.4, "deliver": 0.1, "ttft": 30.6}),
        # Stamps missing (a prefill engine that sent none): those stages are left out.
        ("remote", {"arrived": 1.0, "decode_received": 1.1, "first_token": 1.6}, {"route": 0.1}),
        # Clocks of two hosts a little apart: never a negative duration.
        ("remote", {"prefill_finished": 5.0, "first_token": 4.99}, {"handoff": 0.0}),
        # The decode engine's stamps split the handoff; push also shows its registration.
        ("remote", {**REMOTE, "kv_requested": 100.05, "kv_landed": 102.2},
         {"route": 0.01, "bind": 0.02, "prefill_hop": 0.01, "prefill_queue": 0.06, "prefill_compute": 2.0,
          "register": 0.02, "handoff": 0.2, "transfer": 0.1, "first_step": 0.1, "deliver": 0.01, "ttft": 2.31}),
        # Push: the WRITE's start (prefill's worker, through decode's) splits the transfer.
        ("remote", {**REMOTE, "kv_requested": 100.05, "write_started": 102.13, "kv_landed": 102.2},
         {"route": 0.01, "bind": 0.02, "prefill_hop": 0.01, "prefill_queue": 0.06, "prefill_compute": 2.0,
          "register": 0.02, "handoff": 0.2, "transfer": 0.1, "write_wait": 0.03, "write": 0.07, "first_step": 0.1,
          "deliver": 0.01, "ttft": 2.31}),
        # Decode's first step, split: scheduled after the KV landed, the engine core's output, on to the replica.
        ("remote", {**REMOTE, "kv_requested": 100.05, "kv_landed": 102.2, "first_scheduled": 102.21,
                    "engine_output": 102.28},
         {"route": 0.01, "bind": 0.02, "prefill_hop": 0.01, "prefill_queue": 0.06, "prefill_compute": 2.0,
          "register": 0.02, "handoff": 0.2, "transfer": 0.1, "first_step": 0.1, "schedule": 0.01, "forward": 0.07,
          "output": 0.02, "deliver": 0.01, "ttft": 2.31}),
        # The routers' picks split the route and the prefill hop.
        ("remote", {**REMOTE, "decode_picked": 100.004, "prefill_picked": 100.032},
         {"route": 0.01, "decode_pick": 0.004, "decode_hop": 0.006, "bind": 0.02, "prefill_hop": 0.01,
          "prefill_pick": 0.022, "prefill_queue": 0.06, "prefill_compute": 2.0, "handoff": 0.2, "deliver": 0.01,
          "ttft": 2.31}),
        ("local", {"arrived": 1.0, "decode_picked": 1.02, "decode_received": 1.1, "first_token": 1.6, "first_chunk": 1.7},
         {"route": 0.1, "decode_pick": 0.02, "decode_hop": 0.08, "local_prefill": 0.5, "deliver": 0.1, "ttft": 0.7}),
    ],
)
def test_stages_from_stamps(route, stamps, expected):
    stages = RequestTimeline("r", "push", route, True, dict(stamps)).stages()
    assert stages == pytest.approx(expected)
    assert set(stages) <= set(STAGES)


def test_pull_allocates_after_prefill_answered_so_it_has_no_register_stage():
    stamps = {**REMOTE, "kv_requested": 102.15, "kv_landed": 102.2}
    stages = RequestTimeline("r", "pull", "remote", True, stamps).stages()
    assert "register" not in stages and stages["transfer"] == pytest.approx(0.1)
    assert stages["read"] == pytest.approx(0.05) and "write" not in stages


def test_the_first_stamp_counts_and_the_prefill_report_is_read_defensively():
    timeline = RequestTimeline("r", "pull", "remote", False)
    timeline.stamp("first_token", 2.0)
    timeline.stamp("first_token", 3.0)
    timeline.add_prefill_report({"queued": 1.0, "started": None, "finished": "soon"})
    timeline.add_prefill_report(None)
    assert timeline.stamps == {"first_token": 2.0, "prefill_queued": 1.0}


def test_a_timeline_is_one_log_line_that_reads_back():
    timeline = RequestTimeline("rdv-1", "push", "remote", True, dict(REMOTE))
    line = "(ServeReplica:rendezvous:OpenAiIngress pid=1) INFO -- " + timeline.to_log_line()
    assert line.count("\n") == 0
    assert json.loads(line.split(LOG_MARKER, 1)[1])["stages"]["handoff"] == pytest.approx(0.2)
    assert RequestTimeline.from_log_line(line) == timeline
    assert RequestTimeline.from_log_line("INFO something else") is None


def test_the_log_line_and_the_stage_labels_say_mode_and_route_as_plain_strings(monkeypatch):
    """``python -m bench timeline`` and the dashboards read these strings; the fields themselves are enums."""
    import app.ingress.server as ingress
    from app.request.envelope import Route
    from connector.params import TransferMode

    observed, logged = [], []
    monkeypatch.setattr(ingress.metrics, "stage_seconds", lambda: SimpleNamespace(
        observe=lambda seconds, tags: observed.append(tags)))
    monkeypatch.setattr(ingress.logger, "info", lambda fmt, line: logged.append(line))
    timeline = RequestTimeline("rdv-1", TransferMode.PULL, Route.FALLBACK, True, {"arrived": 1.0, "first_chunk": 2.0})
    ingress.record_timeline(timeline)
    assert observed == [{"mode": "pull", "stage": "ttft"}] and type(observed[0]["mode"]) is str
    raw = json.loads(logged[0].split(LOG_MARKER, 1)[1])
    assert (raw["mode"], raw["route"]) == ("pull", "fallback")
    back = RequestTimeline.from_log_line(logged[0])
    assert (back.mode, back.route) == (TransferMode.PULL, Route.FALLBACK)
    assert RequestTimeline.from_log_line(logged[0].replace('"fallback"', '"sideways"')) is None  # a route unknown here


def _server_answering(chunks):
    from tests.support.decode_server import decode_server

    async def remote(request, raw=None):
        server.seen.append((request, raw))
        for chunk in chunks:
            yield chunk

    server = decode_server(push=remote)
    return server


def _all(server, request):
    async def go():
        return [c async for c in await server.completions(request)]

    return asyncio.run(go())


def test_decode_sends_its_timeline_before_a_whole_response_and_after_a_stream():
    whole = _all(_server_answering(["response"]), CompletionRequest(model="m", prompt="hi"))
    assert isinstance(whole[0], RequestTimeline) and whole[1:] == ["response"]
    assert not whole[0].stream and whole[0].route == "remote"
    assert whole[0].stamps["decode_received"] <= whole[0].stamps["first_token"]

    streamed = _all(_server_answering(["a", "b"]), CompletionRequest(model="m", prompt="hi", stream=True))
    assert streamed[:2] == ["a", "b"] and isinstance(streamed[2], RequestTimeline) and streamed[2].stream


def test_a_whole_answers_first_token_is_when_the_engine_had_it_not_when_the_answer_came():
    """app.decode.first_token: a whole answer comes after its last token; the engine noted its first. A time the
    engine could not have had it (before the request reached decode, after the answer) is not taken; a stream's first
    token is its first chunk. Either way the engine core's output of it is stamped (engine_output)."""
    from app.decode.first_token import FirstToken
    from tests.support.decode_server import decode_server

    asked, received = [], []

    async def remote(request, raw=None):
        received.append(time.time())
        await asyncio.sleep(0.05)
        yield "response"

    def answering(offset_s):
        def first_token(request_id):
            asked.append(request_id)
            return FirstToken(engine_at=received[-1] + offset_s - 0.002, frontend_at=received[-1] + offset_s)
        return decode_server(push=remote, first_token=first_token)

    (timeline, _) = _all(answering(0.01), CompletionRequest(model="m", prompt="hi"))
    assert timeline.stamps["first_token"] == received[-1] + 0.01  # the engine's: 40 ms before the answer came
    assert timeline.stamps["engine_output"] == received[-1] + 0.008
    assert len(asked) == 1 and asked[0].startswith("rdv-")
    for implausible in (-1.0, 60.0):
        (timeline, _) = _all(answering(implausible), CompletionRequest(model="m", prompt="hi"))
        assert received[-1] + 0.04 <= timeline.stamps["first_token"] <= time.time()  # the answer's own time
        assert "engine_output" not in timeline.stamps
    streamed = _all(answering(0.01), CompletionRequest(model="m", prompt="hi", stream=True))[-1]
    assert streamed.stamps["first_token"] >= received[-1] + 0.04  # its first chunk's time
    assert streamed.stamps["engine_output"] == received[-1] + 0.008


@pytest.mark.parametrize("failed", [None, "kv_deadline", "kv_failed"])
def test_a_remote_request_whose_kv_never_landed_is_counted_by_why_decode_recomputed_it(failed):
    """The decode engine's failure datagram (connector.stages.KvFailure) reaches the replica before the
    first token (decode recomputes the prompt first): the request counts under that rung."""

    from tests.support.decode_server import decode_server

    async def remote(request, raw=None):
        server.engine_stamped(DecodeKvStamps(request.request_id, requested=1.0, landed=None if failed else 2.0,
                                             failed=failed))
        yield "chunk"

    server = decode_server(push=remote)
    chunks = _all(server, CompletionRequest(model="m", prompt="hi"))
    assert server.paths == [failed or "remote"]
    assert chunks[0].kv_failure == failed and ("kv_landed" in chunks[0].stamps) == (failed is None)


def test_no_timeline_before_an_error_the_ingress_turns_into_a_status():
    from ray.llm._internal.serve.core.configs.openai_api_models import ErrorInfo, ErrorResponse

    error = ErrorResponse(error=ErrorInfo(message="bad", type="BadRequestError", code=400))
    assert _all(_server_answering([error]), CompletionRequest(model="m", prompt="hi")) == [error]


def test_the_ingress_completes_and_records_a_timeline_before_yielding_a_whole_response(monkeypatch):
    import app.ingress.server as ingress

    recorded = []
    monkeypatch.setattr(ingress, "record_timeline", recorded.append)
    timeline = RequestTimeline("r", "push", "remote", False, {"decode_received": 10.5, "first_token": 11.0})

    from types import SimpleNamespace

    response = SimpleNamespace(usage=SimpleNamespace(completion_tokens=7))  # a whole answer, with its usage
    state = SimpleNamespace()

    async def decode():
        yield timeline
        yield response

    async def first_only():  # upstream reads one item of a non-streamed response, then stops
        responses = ingress.timelines_recorded(decode(), arrived=10.0, state=state)
        return await responses.__anext__()

    assert asyncio.run(first_only()) is response
    assert recorded == [timeline]
    assert timeline.stamps["arrived"] == 10.0 and timeline.stamps["first_chunk"] >= 11.0
    assert set(timeline.stages()) == {"route", "deliver", "ttft"}  # no prefill stamps came
    # What admission learns a whole answer's TTFT and TPOT from (app.routing.admission).
    assert (state.rendezvous_first_token, state.rendezvous_output_tokens) == (11.0, 7)


class _Staged:
    """A fake of vLLM's connector scheduler (the host) with the stage clock composed in: each hook calls the
    clock where connector.push_connector.PushScheduler (and pull_connector.PullScheduler) call it, around the
    host's own."""

    def __init__(self, host, clock):
        self.host, self.stages = host, clock

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        stage = self.stages.before_alloc(request)
        self.host.update_state_after_alloc(request, blocks, num_external_tokens)
        self.stages.allocated(request, blocks, num_external_tokens, stage)

    def update_connector_output(self, connector_output):
        self.host.update_connector_output(connector_output)
        self.stages.output(connector_output)

    def build_connector_meta(self, scheduler_output):
        self.stages.built(scheduler_output)

    def request_finished(self, request, block_ids):
        stages = self.stages.finishing(request)
        delay, params = self.host.request_finished(request, block_ids)
        self.stages.finished(stages, params)
        return delay, params


def test_the_prefill_engine_reports_queued_started_finished_for_a_leg():
    from connector.stages import StageClock

    class Upstream:
        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            pass

        def request_finished(self, request, block_ids):
            request.kv_transfer_params = {"do_remote_decode": False}  # vLLM rewrites them
            return True, {"remote_block_ids": [1]}

    scheduler = _Staged(Upstream(), StageClock(None))
    leg = SimpleNamespace(request_id="p", arrival_time=50.0, num_prompt_tokens=300,
                          kv_transfer_params={"do_remote_decode": True})
    scheduler.update_state_after_alloc(leg, None, 200)  # 200 of them read back (a conversation's history)
    scheduler.update_state_after_alloc(leg, None, 0)  # a later chunk: the first start counts
    delay, params = scheduler.request_finished(leg, [[1]])
    report = params[STAGES_KEY]
    assert delay and report["queued"] == 50.0 and report["queued"] < report["started"] <= report["finished"]
    assert (report["prompt_tokens"], report["computed_tokens"]) == (300, 100)
    decode_request = SimpleNamespace(request_id="d", arrival_time=1.0, kv_transfer_params={"do_remote_prefill": True})
    assert STAGES_KEY not in scheduler.request_finished(decode_request, [[1]])[1]


def test_the_decode_engine_sends_when_its_remote_kv_was_asked_for_and_landed_or_why_it_never_did(monkeypatch):
    """Decode side of connector.stages: one datagram per request whose KV landed, read by
    the serving process's listener, and one when the step that computes its first token is scheduled; one naming the failure for a request whose load failed
    (vLLM reports its blocks invalid and recomputes it): past push's KV deadline, or not;
    a request that was aborted sends nothing."""
    import connector.stages as stages

    monkeypatch.setattr(stages.os, "getppid", stages.os.getpid)  # this process plays the replica
    clock = [1000.0]
    monkeypatch.setattr(stages.time, "time", lambda: clock[0])

    class Upstream:
        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            request.kv_transfer_params = {"do_remote_prefill": False}  # vLLM clears it once registered

        def update_connector_output(self, connector_output):
            pass

        def request_finished(self, request, block_ids):
            return False, None

    def decode_request(rid):
        return SimpleNamespace(request_id=rid, kv_transfer_params={"do_remote_prefill": True})

    def blocks(*ids):
        return SimpleNamespace(get_block_ids=lambda: (list(ids),))

    async def run():
        heard = []
        sock = stages.listen_for_decode_stamps(heard.append)
        assert sock is not None
        scheduler = _Staged(Upstream(), stages.StageClock(60.0))  # push's deadline (connector.push_deadline)
        names = ["chatcmpl-rdv-1", "chatcmpl-rdv-2", "chatcmpl-rdv-3", "chatcmpl-rdv-4"]
        for i, name in enumerate(names):
            scheduler.update_state_after_alloc(decode_request(name), blocks(10 * i, 10 * i + 1), 64)
        scheduler.request_finished(decode_request(names[1]), [])  # aborted
        clock[0] += 1.0
        scheduler.update_connector_output(SimpleNamespace(finished_recving={names[0], names[1], names[2]},
                                                          invalid_block_ids={21}))  # 3's transfer failed
        clock[0] += 0.25
        scheduler.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"other": 5}))  # 1 not scheduled yet
        clock[0] += 0.25
        scheduler.build_connector_meta(SimpleNamespace(num_scheduled_tokens={names[0]: 1, names[2]: 64}))
        scheduler.build_connector_meta(SimpleNamespace(num_scheduled_tokens={names[0]: 1}))  # its first step counts
        clock[0] += 60.0
        scheduler.update_connector_output(SimpleNamespace(finished_recving={names[3]}, invalid_block_ids={30, 31}))
        for _ in range(100):
            if len(heard) == 4:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        asyncio.get_running_loop().remove_reader(sock.fileno())
        sock.close()
        return heard

    heard = sorted(asyncio.run(run()), key=lambda s: (s.request_id, s.scheduled or 0))
    assert [(s.request_id, s.requested, s.landed, s.scheduled, s.failed) for s in heard] == [
        ("chatcmpl-rdv-1", 1000.0, 1001.0, None, None),
        ("chatcmpl-rdv-1", None, None, 1001.5, None),  # the step computing its first token, once (3 recomputes)
        ("chatcmpl-rdv-3", 1000.0, None, None, "kv_failed"),
        ("chatcmpl-rdv-4", 1000.0, None, None, "kv_deadline"),
    ]
    assert heard[0].write_started is None
    assert stages.DecodeKvStamps.from_wire(b"not json") is None
    assert stages.DecodeKvStamps.from_wire(b'{"request_id": 7}') is None


def test_prefill_tells_decode_when_its_write_starts_and_decode_tells_its_replica(monkeypatch):
    """connector.stages.WriteClock: the prefill worker notifies every agent of decode's engine just
    before the WRITE; decode's worker turns that notification into a stamp for its replica and
    hands vLLM only the notifications that are vLLM's."""
    import connector.stages as stages
    from connector.side_notifs import WRITE_STARTED_NOTIF, SideRoutingQueue

    monkeypatch.setenv(stages.STAMPS_PID_ENV, str(stages.os.getpid()))  # this process plays the replica

    class Upstream:
        def __init__(self):
            self._remote_agents = {"decode-engine": {(0, 0): "agent-0", (0, 1): "agent-1"}}
            self._pending_completion_notifs = SideRoutingQueue()
            self.sent, self.written, self.vllm_saw = [], [], []
            self.nixl_wrapper = SimpleNamespace(send_notif=lambda agent, notif_msg: self.sent.append((agent, notif_msg)))

        def _xfer_blocks_for_req(self, req_id, meta):
            self.written.append(req_id)

        def _get_new_notifs(self):
            while not self._pending_completion_notifs.empty():
                self.vllm_saw.append(self._pending_completion_notifs.get_nowait())
            return set()

    class Worker(Upstream):
        """The fake above as the host, with the write clock composed in as connector.push_connector.PushWorker
        composes it."""

        def __init__(self):
            super().__init__()
            self._clock = stages.WriteClock(self)

        def _xfer_blocks_for_req(self, req_id, meta):
            self._clock.writing(req_id, meta)
            return super()._xfer_blocks_for_req(req_id, meta)

        def _get_new_notifs(self):
            self._clock.take_notifs()
            return super()._get_new_notifs()

    prefill = Worker()
    meta = SimpleNamespace(remote=SimpleNamespace(engine_id="decode-engine", request_id="chatcmpl-rdv-3-abc"))
    prefill._xfer_blocks_for_req("prefill-id", meta)
    assert prefill.written == ["prefill-id"]
    assert [agent for agent, _ in prefill.sent] == ["agent-0", "agent-1"]

    async def run():
        heard = []
        sock = stages.listen_for_decode_stamps(heard.append)
        decode = Worker()
        for notif in (prefill.sent[0][1], b"chatcmpl-rdv-3-abc:1", WRITE_STARTED_NOTIF + b"garbage"):
            decode._pending_completion_notifs.put(notif)
        decode._get_new_notifs()
        for _ in range(100):
            if heard:
                break
            await asyncio.sleep(0.01)
        asyncio.get_running_loop().remove_reader(sock.fileno())
        sock.close()
        return heard, decode.vllm_saw

    heard, vllm_saw = asyncio.run(run())
    assert vllm_saw == [b"chatcmpl-rdv-3-abc:1"]  # vLLM's completion notification, and only it
    assert [(s.request_id, s.requested, s.landed) for s in heard] == [("chatcmpl-rdv-3-abc", None, None)]
    assert abs(heard[0].write_started - time.time()) < 60


def test_chunk_writes_that_land_are_stamped_and_drawn_as_streamed_over_the_prefill():
    """Progressive push: decode's worker stamps each chunk WRITE's notification (as vLLM sends it: the id we
    gave, then the prefill world size); the timeline keeps the earliest landing and counts the chunks, whichever
    rank's datagram comes first, and `streamed` runs from the first chunk landed to prefill's end."""
    from connector.stages import chunk_notif_id, parse_chunk_landed

    notifs = [f"{chunk_notif_id('cmpl-rdv-9-0', i)}:3".encode() for i in (1, 0, 2)]
    stamps = [parse_chunk_landed(n, at) for n, at in zip(notifs, (1.4, 1.2, 1.6))]
    assert [(s.request_id, s.chunk, s.chunk_landed) for s in stamps] == [
        ("cmpl-rdv-9-0", 1, 1.4), ("cmpl-rdv-9-0", 0, 1.2), ("cmpl-rdv-9-0", 2, 1.6)]
    assert parse_chunk_landed(b"rdv-chunk:no-index:1", 1.0) is None
    assert DecodeKvStamps.from_wire(stamps[0].to_wire()) == stamps[0]
    timeline = RequestTimeline("rdv-9", "push", "remote", True, {"prefill_started": 1.0, "prefill_finished": 2.0})
    for s in stamps:
        timeline.add_decode_kv_stamps(s)
    assert (timeline.stamps["first_chunk_landed"], timeline.chunk_writes) == (1.2, 3)
    assert timeline.stages()["streamed"] == pytest.approx(0.8)
    pulled = RequestTimeline("rdv-9", "pull", "remote", True, dict(timeline.stamps))
    assert "streamed" not in pulled.stages()
    assert RequestTimeline.from_log_line(timeline.to_log_line()) == timeline


def test_the_replica_finds_its_request_by_the_engine_id():
    from connector.params import engine_request_id, external_request_id

    assert external_request_id(engine_request_id("chat", "rdv-7")) == "rdv-7"
    assert external_request_id(engine_request_id("completions", "rdv-7") + "-0") == "rdv-7"  # vLLM adds the prompt index
    assert external_request_id("rdv-7") == "rdv-7"


def test_the_decode_router_stamps_its_pick_on_the_request_it_sends():
    """Serve sends the arguments after the pick: the stamp travels with the request."""
    from types import SimpleNamespace

    from ray.llm._internal.serve.core.configs.openai_api_models import ChatCompletionRequest, CompletionRequest

    from app.request.envelope import DECODE_PICKED_AT
    from app.routing.decode_router import _stamp_pick

    for request in (CompletionRequest(model="m", prompt="hi"), ChatCompletionRequest(model="m", messages=[])):
        assert DECODE_PICKED_AT.read(request) is None
        _stamp_pick(SimpleNamespace(args=(request, None)))
        first = DECODE_PICKED_AT.read(request)
        assert first is not None and DECODE_PICKED_AT.read(request.model_copy()) == first  # survives the replica's copies
        _stamp_pick(SimpleNamespace(args=(request, None)))  # picked again (the first replica was full)
        assert DECODE_PICKED_AT.read(request) >= first
    _stamp_pick(SimpleNamespace(args=()))  # nothing to stamp: no error
