"""app.replica.streaming: a stream's first chunk leaves as soon as it exists; the rest is batched as Ray batches it."""

from __future__ import annotations

import asyncio
import time

import pytest
from ray.llm._internal.serve.utils.batcher import Batcher

from app.replica.streaming import FirstChunkAtOnce

INTERVAL_MS = 50.0


async def engine_stream(delay_s: float = 0.01):
    """A chat stream as vLLM's OpenAI layer yields it: the role chunk and the first content back to back (one engine
    output), then a token every ``delay_s``."""
    await asyncio.sleep(delay_s)
    yield "role"
    yield "t0"
    for i in range(1, 10):
        await asyncio.sleep(delay_s)
        yield f"t{i}"


async def batches(batcher_cls, generator, interval_ms=INTERVAL_MS):
    started, out = time.monotonic(), []
    async for batch in batcher_cls(generator, interval_ms=interval_ms).stream():
        out.append((time.monotonic() - started, list(batch)))
    return out


def test_the_first_batch_leaves_with_the_first_chunk_not_an_interval_later():
    ours = asyncio.run(batches(FirstChunkAtOnce, engine_stream()))
    rays = asyncio.run(batches(Batcher, engine_stream()))
    assert ours[0][1] == ["role", "t0"] and ours[0][0] < 0.035  # with the chunk of the same output
    assert rays[0][0] >= INTERVAL_MS / 1000 * 0.9  # Ray's own: its first tick
    assert [c for _, batch in ours for c in batch] == [c for _, batch in rays for c in batch]  # nothing lost or moved
    assert len(ours) <= len(rays) + 1  # later chunks are batched as Ray batches them


@pytest.mark.parametrize("interval_ms", [0, None])
def test_rays_own_meanings_of_no_interval_are_kept(interval_ms):
    ours = asyncio.run(batches(FirstChunkAtOnce, engine_stream(0.001), interval_ms))
    rays = asyncio.run(batches(Batcher, engine_stream(0.001), interval_ms))
    assert [b for _, b in ours] == [b for _, b in rays]


def test_an_empty_stream_and_a_failing_one_end_as_with_ray():
    async def empty():
        return
        yield

    async def failing():
        yield "role"
        raise RuntimeError("engine died")

    assert asyncio.run(batches(FirstChunkAtOnce, empty())) == []
    with pytest.raises(RuntimeError, match="engine died"):
        asyncio.run(batches(FirstChunkAtOnce, failing()))


def test_a_consumer_that_goes_away_before_the_first_chunk_stops_the_reading():
    started = asyncio.Event()

    async def never():
        started.set()
        await asyncio.sleep(3600)
        yield "never"

    async def go():
        batcher = FirstChunkAtOnce(never(), interval_ms=INTERVAL_MS)
        consumer = asyncio.ensure_future(batcher.stream().__anext__())
        await started.wait()
        consumer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await consumer
        await asyncio.sleep(0)
        return batcher.read_task.cancelled() or batcher.read_task.done()

    assert asyncio.run(go())
