"""Ad-hoc: TPOT/TTFT of push under a Poisson load of 1k-token prompts (streamed completions)."""
import asyncio, json, random, statistics, sys, time
import httpx

WORDS = "river fox stone cloud lantern meadow copper violin harbor maple".split()
RATE, SECONDS, OUT = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]

async def one(client, i, results):
    rng = random.Random(i)
    prompt = " ".join(rng.choice(WORDS) + str(rng.randint(0, 999)) for _ in range(250))
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 64, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter(); stamps = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                stamps.append(time.perf_counter())
    if len(stamps) > 2:
        results.append({"i": i, "ttft": stamps[0] - t0, "tpot": (stamps[-1] - stamps[0]) / (len(stamps) - 1), "n": len(stamps)})

async def main():
    rng = random.Random(7); results = []; tasks = []
    async with httpx.AsyncClient(base_url="http://127.0.0.1:8000", timeout=600) as client:
        start = time.perf_counter(); i = 0
        while time.perf_counter() - start < SECONDS:
            tasks.append(asyncio.create_task(one(client, i, results))); i += 1
            await asyncio.sleep(rng.expovariate(RATE))
        await asyncio.gather(*tasks)
    json.dump(results, open(OUT, "w"))
    print(f"{len(results)} requests: TTFT p50 {statistics.median(r['ttft'] for r in results)*1000:.0f} ms, "
          f"TPOT p50 {statistics.median(r['tpot'] for r in results)*1000:.1f} ms, mean {statistics.mean(r['tpot'] for r in results)*1000:.1f}")

asyncio.run(main())
