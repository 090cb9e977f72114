"""Time connector.kv_checksum's digests on one rank of the GPU geometry (Qwen3-32B on a P5en: 64 layers, K and V
regions, 8 KV heads / TP 8 = 1 head x 128 dims, bf16, 16-token blocks) for a 16k-token request whose 1,024 blocks
came back in reverse order, as a warm engine hands them out. Against the sum per run of consecutive ids it
replaced (the old code, inlined below; kv_part_sums now keeps it for a few runs only), and against what NIXL moves the same bytes in on this box.

    .venv/bin/python docs/results/kv-checksum-gpu-geometry.py > docs/results/kv-checksum-gpu-geometry.json
"""
import json
import time

import torch

from connector.kv_checksum import KvSumsCheck
from connector.kv_digest import region_weights

REGIONS, CACHE_BLOCKS, BLOCK_WORDS = 64 * 2, 1100, 16 * 1 * 128 * 2 // 8  # int64 words of one region's block
NIXL_WRITE_GBPS = 7.0  # bench nixl-bandwidth on this box (docs/benchmarks.md, "NIXL bandwidth")


def per_run(regions, block_ids, parts=1):
    """The code before (one sum per run of consecutive block ids)."""
    runs = []
    for block in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block, 1))
    return torch.stack([torch.cat([r[s:s + n].reshape(n, parts, -1).sum(dim=2) for s, n in runs])
                        for r in regions]).cpu().numpy()


def median_ms(fn, repeats=5):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(sorted(times)[len(times) // 2] * 1000, 1)


torch.set_num_threads(1)  # as the engines run on CPU (OMP_NUM_THREADS=1)
regions = list(torch.randint(-2**40, 2**40, (REGIONS, CACHE_BLOCKS, BLOCK_WORDS), dtype=torch.int64).unbind(0))
worker = KvSumsCheck()
worker._kv_regions = lambda: regions
out = {"regions": REGIONS, "block_bytes": BLOCK_WORDS * 8}
for label, ids in (("reversed", list(range(1023, -1, -1))), ("consecutive", list(range(1024)))):
    folded = (torch.from_numpy(per_run(regions, ids)) * region_weights(REGIONS, "cpu").view(-1, 1, 1)).sum(0, True)
    assert (worker.kv_part_sums(ids) == folded.numpy()).all()  # the digests: the regions' sums, weighed
    mib = len(ids) * REGIONS * BLOCK_WORDS * 8 / 2**20
    transfer_ms = mib * 2**20 / (NIXL_WRITE_GBPS * 1e9) * 1000
    now = median_ms(lambda: worker.kv_part_sums(ids))
    runs = median_ms(lambda: per_run(regions, ids))
    out[label] = {"blocks": len(ids), "MiB": round(mib), "kv_part_sums_ms": now, "sum_per_run_ms": runs,
                  "nixl_transfer_ms_at_7GBps": round(transfer_ms, 1),
                  "share_of_transfer": round(now / transfer_ms, 3),
                  "sums_bytes_sent_per_rank": len(ids) * 8, "before_digests_bytes": len(ids) * REGIONS * 8}
print(json.dumps(out, indent=1))
