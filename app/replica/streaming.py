"""Streams whose first chunk goes out as soon as the engine has it.

Ray Serve LLM hands a stream's chunks on in batches, every ``stream_batching_interval_ms`` (50 ms by default:
fewer Ray messages per token at high token rates). Its batcher waits a whole interval before the first batch too,
so a stream's first token waited up to 50 ms in the serving replica after the engine had it: the timeline's
``output`` stage, 18-32 ms at the median on the idle app (docs/results/timeline-0.32-256). Here the first batch goes
as soon as the first chunk is there, with whatever the same engine output brought along (a chat stream's role chunk
and its first content), and the rest is batched as Ray batches it. The decode servers and the benchmarks'
aggregated baseline both stream this way, so that comparisons between them stay fair.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from ray.llm._internal.serve.core.server.llm_server import LLMServer
from ray.llm._internal.serve.utils.batcher import Batcher


class FirstChunkAtOnce(Batcher):
    """Ray's batcher, except that its first batch is yielded when the first chunk comes, not an interval later."""

    def __init__(self, generator: AsyncGenerator[Any, None], interval_ms: float | None):
        self._arrived = asyncio.Event()
        super().__init__(self._noting_arrival(generator), interval_ms)

    async def _noting_arrival(self, generator: AsyncGenerator[Any, None]) -> AsyncGenerator[Any, None]:
        async for item in generator:
            self._arrived.set()  # its waiter runs once the reading task pauses: after it queued the item
            yield item

    async def stream(self) -> AsyncGenerator[Any, None]:
        if not self.interval_s:  # 0: every chunk at once; None: the whole output at once (Ray's own meanings)
            async for batch in super().stream():
                yield batch
            return
        try:
            waits = [asyncio.ensure_future(self._arrived.wait()), asyncio.ensure_future(self.done_event.wait())]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()
            await asyncio.sleep(0)  # chunks of the same engine output, queued right behind the first
            first = self.drain_queue()
            if first:
                yield self._merge_results(first)
        except BaseException:
            if not self.read_task.done():
                self.read_task.cancel()
            raise
        async for batch in super().stream():  # then every interval, as Ray does
            yield batch


class StreamsFirstChunkAtOnce:
    """For an ``LLMServer`` subclass: its streams' first chunk goes out at once (:class:`FirstChunkAtOnce`)."""

    def _batch_output_stream(self, generator: AsyncGenerator[Any, None]) -> AsyncGenerator[Any, None]:
        return FirstChunkAtOnce(generator, interval_ms=self._get_batch_interval_ms()).stream()


class AggregatedServer(StreamsFirstChunkAtOnce, LLMServer):
    """The benchmarks' aggregated engine (``app.aggregated``): Ray Serve LLM's own server, streaming as ours do."""
