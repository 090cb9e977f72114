"""Open-loop Poisson arrivals from a process of their own: ``python -m bench.openloop``.

Under overload a client's own delays must not be counted as the server's. Hundreds of
threads in a process that does other work too (pytest, a reference engine) read an
answer well after it arrived; here one asyncio loop sends every request at its arrival
time and stamps each answer when its last byte is in. One JSON line per request.

That process still shares the box's cores with the server, and when it is starved an answer
that arrived meanwhile is read late. Each outcome carries the longest stall of the client's
own loop while the request was out (``client_stall_s``), so that a reader can tell a slow
server from a slow client.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Outcome:
    index: int
    status: int  # 0: no HTTP answer (the error is in ``response``)
    latency_s: float  # request sent -> answer complete
    retry_after: str | None
    response: Any  # the JSON body, or its text if it is not JSON (a stream's events)
    first_byte_s: float | None = None  # request sent -> the first byte of the body (a stream's first event)
    client_stall_s: float = 0.0  # the longest stall of this client's loop while the request was out
    sent_s: float = 0.0  # when it was sent, from the first arrival


class StallClock:
    """When this process's event loop ran late, and by how much: a task that asks to wake every
    ``tick_s`` and records each wake-up that came more than ``slack_s`` late. An answer that
    arrived during a stall was read up to that stall late."""

    def __init__(self, tick_s: float = 0.02, slack_s: float = 0.05) -> None:
        self.tick_s, self.slack_s = tick_s, slack_s
        self.stalls: list[tuple[float, float]] = []  # (monotonic time it ended, seconds late), in time order

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time()
            await asyncio.sleep(self.tick_s)
            late = loop.time() - asked - self.tick_s
            if late > self.slack_s:
                self.stalls.append((time.monotonic(), late))

    def worst_since(self, since: float) -> float:
        """The longest stall that ended at or after ``since`` (monotonic)."""
        i = bisect.bisect_left(self.stalls, (since, 0.0))
        return max((late for _, late in self.stalls[i:]), default=0.0)


def body_for(template: dict, index: int) -> dict:
    """``template`` with ``{i}`` in its strings replaced by the request's index (unique prompts)."""
    return json.loads(json.dumps(template).replace("{i}", str(index)))


async def _one(session, path: str, body: dict, index: int, stalls: StallClock, origin: float) -> Outcome:
    started = time.monotonic()
    sent = started - origin
    try:
        async with session.post(path, json=body) as r:
            chunks, first = [], None
            async for chunk in r.content.iter_any():
                first = first if first is not None else time.monotonic() - started
                chunks.append(chunk)
            text = b"".join(chunks).decode(errors="replace")
            latency, status, retry_after = time.monotonic() - started, r.status, r.headers.get("retry-after")
    except Exception as exc:  # noqa: BLE001 - recorded, a lost request for the caller to judge
        return Outcome(index, 0, time.monotonic() - started, None, f"{type(exc).__name__}: {exc}",
                       client_stall_s=stalls.worst_since(started), sent_s=sent)
    try:
        response = json.loads(text)
    except ValueError:
        response = text
    return Outcome(index, status, latency, retry_after, response, first, stalls.worst_since(started), sent)


async def poisson_arrivals(rate: float, seconds: float, rng: random.Random,
                           launch: Callable[[int, StallClock, float], Awaitable[T]]) -> list[T]:
    """``launch(index, stalls, start)`` at Poisson arrivals of ``rate`` per second for ``seconds``
    (``start``: the first arrival, monotonic), while a :class:`StallClock` watches this loop; every
    launched request awaited, in arrival order."""
    tasks: list[asyncio.Task] = []
    stalls = StallClock()
    clock = asyncio.create_task(stalls.run())
    start = next_at = time.monotonic()
    try:
        while next_at < start + seconds:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            tasks.append(asyncio.create_task(launch(len(tasks), stalls, start)))
            next_at += rng.expovariate(rate)
        return list(await asyncio.gather(*tasks))
    finally:
        clock.cancel()


async def offer(
    base_url: str, path: str, template: dict, rate: float, seconds: float, seed: int = 0, first_index: int = 0
) -> list[Outcome]:
    """Poisson arrivals at ``rate`` per second for ``seconds``; every answer awaited.
    aiohttp, as vLLM's benchmark client: httpx's pool slows down with hundreds of
    connections open (measured: 429s read 19 s late at p99)."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(base_url, timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        def launch(i: int, stalls: StallClock, start: float):
            index = first_index + i
            return _one(session, path, body_for(template, index), index, stalls, start)

        return await poisson_arrivals(rate, seconds, random.Random(seed), launch)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.openloop", description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--path", default="/v1/completions")
    parser.add_argument("--body", required=True, help="JSON request body; {i} in its strings becomes the request's index")
    parser.add_argument("--rate", type=float, required=True, help="requests per second (Poisson)")
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--first-index", type=int, default=0)
    parser.add_argument("--out", required=True, help="JSON lines, one per request")
    a = parser.parse_args(argv)
    outcomes = asyncio.run(offer(a.base_url, a.path, json.loads(a.body), a.rate, a.seconds, a.seed, a.first_index))
    with Path(a.out).open("w") as f:
        for outcome in outcomes:
            f.write(json.dumps(asdict(outcome)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
