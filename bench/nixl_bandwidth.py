"""``python -m bench nixl-bandwidth``: this machine's NIXL WRITE bandwidth for KV-sized
transfers, next to a plain memory copy of the same size.

Two NIXL agents in one process, one registered DRAM buffer each, the initiator WRITEs
its buffer into the target's over the chosen backend (UCX by default) with the same
``UCX_TLS`` the engines get (``connector.engine_env``), so the figure is the ceiling
for a KV transfer between two engines on this host. ``memcpy`` is ``numpy.copyto`` of
the same bytes on one thread. The agents' progress threads get the engines' poll delay
(``connector.nixl_progress``), so an idle one does not take a core from the copy. Each
size is transferred ``--iters`` times after one untimed warm-up; the report gives the
median and the best. The data are checked after the timed WRITEs.

The measurement runs in a child process so the UCX settings reach UCX before it loads
and never touch this process's environment.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SIZES_MIB = (1, 8, 64, 256)
MIB = 1 << 20


def engine_ucx_tls() -> str:
    """The UCX transports an engine gets unless its config overrides them."""
    from connector.engine_env import engine_env

    return engine_env(side_channel_host="127.0.0.1", side_channel_port=0, user_env={})["UCX_TLS"]


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _timed(fn, iters: int) -> list[float]:
    fn()  # warm-up: first touch, connection setup
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def measure(sizes_mib: list[int], iters: int, descriptor_kib: int, backend: str) -> list[dict[str, Any]]:
    """Run in the child: NIXL WRITE and memcpy timings per size."""
    import numpy as np
    from nixl._api import nixl_agent, nixl_agent_config

    from connector.nixl_progress import calm_progress_threads

    calm_progress_threads([backend])  # the engines' agents run this way (connector.vllm_connectors)
    target = nixl_agent("bench-target", nixl_agent_config(backends=[backend]))
    initiator = nixl_agent("bench-initiator", nixl_agent_config(backends=[backend]))
    buffers = []
    for size_mib in sizes_mib:
        nbytes = size_mib * MIB
        src = np.full(nbytes, 7, dtype=np.uint8)
        dst = np.zeros(nbytes, dtype=np.uint8)
        initiator.register_memory([(src.ctypes.data, nbytes, 0, "")], "DRAM")
        target.register_memory([(dst.ctypes.data, nbytes, 0, "")], "DRAM")
        buffers.append((size_mib, nbytes, src, dst))
    # Metadata carries the registrations: exchange it after registering.
    remote = initiator.add_remote_agent(target.get_agent_metadata())
    target.add_remote_agent(initiator.get_agent_metadata())

    rows = []
    for size_mib, nbytes, src, dst in buffers:
        chunk = descriptor_kib * 1024 if descriptor_kib else nbytes
        offsets = range(0, nbytes, chunk)
        src_descs = initiator.get_xfer_descs([(src.ctypes.data + o, min(chunk, nbytes - o), 0) for o in offsets], "DRAM")
        dst_descs = initiator.get_xfer_descs([(dst.ctypes.data + o, min(chunk, nbytes - o), 0) for o in offsets], "DRAM")
        handle = initiator.initialize_xfer("WRITE", src_descs, dst_descs, remote, b"")

        def write():
            state = initiator.transfer(handle)
            while state == "PROC":
                state = initiator.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"NIXL WRITE of {size_mib} MiB ended in state {state}")

        nixl_times = _timed(write, iters)
        if not np.array_equal(src, dst):
            raise RuntimeError(f"NIXL WRITE of {size_mib} MiB: target buffer differs from the source")
        initiator.release_xfer_handle(handle)
        copy_dst = np.empty_like(src)
        copy_times = _timed(lambda: np.copyto(copy_dst, src), iters)
        nixl_median, copy_median = gbps(nbytes, statistics.median(nixl_times)), gbps(nbytes, statistics.median(copy_times))
        rows.append(
            {
                "size_mib": size_mib,
                "descriptors": len(offsets),
                "iters": iters,
                "nixl_write_gbps_median": nixl_median,
                "nixl_write_gbps_best": gbps(nbytes, min(nixl_times)),
                "memcpy_gbps_median": copy_median,
                "memcpy_gbps_best": gbps(nbytes, min(copy_times)),
                "nixl_over_memcpy": nixl_median / copy_median,
            }
        )
    return rows


def run(sizes_mib: list[int], iters: int, descriptor_kib: int, backend: str, out: Path | None) -> list[dict[str, Any]]:
    """Measure in a child process with the engines' UCX transports; print and optionally save."""
    env = dict(os.environ)
    env.setdefault("UCX_TLS", engine_ucx_tls())
    argv = [sys.executable, "-m", "bench.nixl_bandwidth", json.dumps([sizes_mib, iters, descriptor_kib, backend])]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    if done.returncode != 0:
        raise RuntimeError(f"nixl-bandwidth child failed ({done.returncode}):\n{done.stderr[-4000:]}")
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    doc = {"backend": backend, "ucx_tls": env["UCX_TLS"], "memory": "DRAM", "agents": "two, one process", "rows": rows}
    print(format_table(doc))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {out}")
    return rows


def format_table(doc: dict[str, Any]) -> str:
    lines = [
        f"NIXL {doc['backend']} WRITE, {doc['memory']}, {doc['agents']}, UCX_TLS={doc['ucx_tls']}",
        f"{'size MiB':>8} {'descs':>6} {'NIXL GB/s':>10} {'(best)':>8} {'memcpy GB/s':>12} {'(best)':>8} {'NIXL/memcpy':>12}",
    ]
    for r in doc["rows"]:
        lines.append(
            f"{r['size_mib']:>8} {r['descriptors']:>6} {r['nixl_write_gbps_median']:>10.2f} {r['nixl_write_gbps_best']:>8.2f} "
            f"{r['memcpy_gbps_median']:>12.2f} {r['memcpy_gbps_best']:>8.2f} {r['nixl_over_memcpy']:>12.2f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":  # the child: one JSON argument in, one JSON line out
    sizes, n, desc_kib, backend_name = json.loads(sys.argv[1])
    print(json.dumps(measure(sizes, n, desc_kib, backend_name)))
