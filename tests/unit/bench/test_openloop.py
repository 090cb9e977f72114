"""bench/openloop.py: open-loop arrivals against a local aiohttp server, and the client's own stalls."""

from __future__ import annotations


def test_openloop_sends_unique_bodies_at_poisson_arrivals_and_records_every_answer():
    import asyncio

    from aiohttp import web

    from bench.openloop import body_for, offer

    assert body_for({"prompt": "Note {i} says", "n": ["{i}"], "max_tokens": 4}, 7) == {"prompt": "Note 7 says", "n": ["7"], "max_tokens": 4}
    seen = []

    async def answer(request: web.Request) -> web.Response:
        seen.append((await request.json())["prompt"])
        if len(seen) % 2:
            return web.json_response({"ok": len(seen)})
        return web.Response(status=429, headers={"retry-after": "1"}, text="busy")

    async def run():
        app = web.Application()
        app.router.add_post("/v1/completions", answer)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            return await offer(f"http://127.0.0.1:{port}", "/v1/completions", {"prompt": "p{i}"}, rate=200, seconds=0.2,
                               seed=3, first_index=10)
        finally:
            await runner.cleanup()

    outcomes = asyncio.run(run())
    assert 10 <= len(outcomes) <= 90  # ~40 expected
    assert [o.index for o in outcomes] == list(range(10, 10 + len(outcomes)))
    assert sorted(seen) == sorted(f"p{o.index}" for o in outcomes)
    assert {o.status for o in outcomes} == {200, 429}
    assert all(o.retry_after == "1" and o.response == "busy" for o in outcomes if o.status == 429)
    assert all(isinstance(o.response, dict) for o in outcomes if o.status == 200)
    assert all(o.latency_s >= 0 for o in outcomes)
    assert [o.sent_s for o in outcomes] == sorted(o.sent_s for o in outcomes) and outcomes[-1].sent_s < 0.5


def test_openloop_records_how_long_its_own_loop_was_stalled():
    """A request that was out while the client's loop was blocked is charged the stall, one sent
    after it is not (so a slow client is not read as a slow server)."""
    import asyncio
    import time

    from bench.openloop import StallClock

    async def run():
        stalls = StallClock()
        clock = asyncio.create_task(stalls.run())
        before = time.monotonic()
        await asyncio.sleep(0.2)
        time.sleep(0.5)  # the loop is blocked, as when the process is not scheduled
        await asyncio.sleep(0.1)
        after = time.monotonic()
        await asyncio.sleep(0.2)
        clock.cancel()
        return stalls.worst_since(before), stalls.worst_since(after)

    during, later = asyncio.run(run())
    assert 0.4 < during < 0.6 and later == 0.0, (during, later)
