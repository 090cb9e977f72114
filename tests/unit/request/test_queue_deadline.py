"""The queue deadline on the decode replica (app.request.queue_deadline): enforced there for whole answers, sent
to the ingress for streams; both read again while the request waits."""

from __future__ import annotations

import asyncio
import pickle
import time
from types import SimpleNamespace

import pytest

import app.request.queue_deadline as queue_deadline
from app.request.queue_deadline import (
    QueueDeadlineMoved,
    QueueDeadlinePassed,
    QueueExpired,
    before_queue_deadline,
    engine_has_started,
    moving_queue_deadline,
)
from app.request.envelope import QUEUE_DEADLINE_AT


class Engine:
    """A request's chunks after ``delay_s``, remembering whether it was cancelled (as vLLM's
    AsyncLLM.generate is, and then aborts the request)."""

    def __init__(self, delay_s: float, chunks=("answer",)):
        self.delay_s, self.chunks, self.cancelled, self.closed = delay_s, chunks, False, False

    async def generate(self):
        try:
            await asyncio.sleep(self.delay_s)
            for chunk in self.chunks:
                yield chunk
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        finally:
            self.closed = True


@pytest.mark.parametrize(
    "delay_s, started, expect, cancelled",
    [
        (0.0, False, ["answer", "usage"], False),  # answered before the deadline
        (0.3, True, ["answer", "usage"], False),  # started by the deadline: runs to its end
        (0.3, False, [QueueExpired("r1")], True),  # not started: cancelled, QueueExpired instead
    ],
)
def test_a_whole_answer_not_started_by_its_deadline_is_cancelled(delay_s, started, expect, cancelled):
    engine = Engine(delay_s, ("answer", "usage"))
    asked = []

    def has_started():
        asked.append(time.monotonic())
        return started

    async def go():
        at = time.time() + 0.1
        return [c async for c in before_queue_deadline(engine.generate(), lambda: at, has_started, "r1")]

    assert asyncio.run(go()) == expect
    assert engine.cancelled is cancelled and engine.closed
    assert len(asked) == (0 if delay_s == 0 else 1)  # the engine is asked once, at the deadline


def test_a_deadline_that_moves_while_the_request_waits_is_kept_where_it_moved(monkeypatch):
    """Its work's estimate changed (a decode replica's first prefill pick brings the published prefill cost,
    app.request.deadlines): a whole answer is given up on at the new deadline; a stream's ingress is told again."""
    monkeypatch.setattr(queue_deadline, "RECHECK_S", 0.02)
    monkeypatch.setattr(queue_deadline, "MOVED_BY_S", 0.5)
    start = time.time()
    deadline = {"at": start + 30.0}

    async def moved_soon():
        await asyncio.sleep(0.1)
        deadline["at"] = start + 0.2

    async def whole():
        mover = asyncio.ensure_future(moved_soon())
        chunks = [c async for c in before_queue_deadline(Engine(30).generate(), lambda: deadline["at"], lambda: False, "r1")]
        await mover
        return chunks, time.time() - start

    chunks, took = asyncio.run(whole())
    assert chunks == [QueueExpired("r1")] and 0.2 <= took < 2.0
    deadline["at"] = start + 30.0

    async def streamed():
        mover = asyncio.ensure_future(moved_soon())
        chunks = [c async for c in moving_queue_deadline(Engine(0.3).generate(), lambda: deadline["at"])]
        await mover
        return chunks

    assert asyncio.run(streamed()) == [QueueDeadlineMoved(start + 30.0), QueueDeadlineMoved(start + 0.2), "answer"]


def test_a_caller_that_goes_away_while_waiting_cancels_the_request():
    engine = Engine(30)

    async def go():
        task = asyncio.ensure_future(anext(before_queue_deadline(engine.generate(), lambda: time.time() + 10, lambda: False, "r1")))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    assert engine.cancelled and engine.closed


def _processor(states: dict[str, bool], external: dict[str, list[str]]):
    return SimpleNamespace(request_states={i: SimpleNamespace(is_prefilling=p) for i, p in states.items()},
                           external_req_ids=external)


@pytest.mark.parametrize(
    "states, external, started",
    [
        ({"cmpl-rdv-1-0-ab12": False}, {"cmpl-rdv-1-0": ["cmpl-rdv-1-0-ab12"]}, True),  # completions: index appended
        ({"chatcmpl-rdv-1-ab12": False}, {"chatcmpl-rdv-1": ["chatcmpl-rdv-1-ab12"]}, True),
        ({"chatcmpl-rdv-1-ab12": True}, {"chatcmpl-rdv-1": ["chatcmpl-rdv-1-ab12"]}, False),  # still prefilling
        ({"chatcmpl-rdv-2-ab12": False}, {"chatcmpl-rdv-2": ["chatcmpl-rdv-2-ab12"]}, False),  # another request
        ({}, {}, False),  # not in the engine yet (with prefill, in pull mode)
    ],
)
def test_the_engine_tells_whether_a_request_has_its_first_token(states, external, started):
    assert engine_has_started(_processor(states, external), "rdv-1") is started


def test_an_engine_that_cannot_be_read_never_aborts_a_request():
    assert engine_has_started(None, "rdv-1") is True


def test_the_deadline_travels_on_a_request_to_the_decode_replica():
    """It is a field of vLLM's request model: it survives the replica's model_copy and Ray's pickling."""
    from ray.llm._internal.serve.core.configs.openai_api_models import ChatCompletionRequest

    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    assert QUEUE_DEADLINE_AT.read(body) is None
    QUEUE_DEADLINE_AT.write(body, 1234.5)
    copied = pickle.loads(pickle.dumps(body.model_copy(update={"request_id": "rdv-1"})))
    assert QUEUE_DEADLINE_AT.read(copied) == 1234.5


def test_the_ingress_turns_a_replicas_queue_expired_into_its_503(monkeypatch):
    from ray.llm._internal.serve.core.ingress.ingress import OpenAiIngress

    from app.ingress.server import Ingress

    async def upstream(self, *, body, call_method, raw_request=None):
        yield QueueExpired("rdv-1")

    monkeypatch.setattr(OpenAiIngress, "_get_response", upstream)

    async def go():
        ingress = Ingress(llm_deployments={}, model_cards={})  # Ray's constructor: it only keeps the handles it is given
        return [c async for c in ingress._get_response(body=SimpleNamespace(), call_method="chat")]

    with pytest.raises(QueueDeadlinePassed):
        asyncio.run(go())
