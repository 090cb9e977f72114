"""Find and end every process one app run started, engines included.

vLLM engine processes outlive ``ray stop --force`` and a Ctrl-C of ``serve run``
(re-parented to init, still holding NIXL side-channel ports), so we cannot rely on the
process tree. Instead each run exports a marker variable; every descendant — Ray's
raylet and workers, Serve replicas, vLLM EngineCore and workers — inherits it, and
``/proc/<pid>/environ`` tells us who belongs to the run.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
import uuid
from pathlib import Path

MARKER = "RENDEZVOUS_RUN_ID"


def new_run_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env[MARKER] = uuid.uuid4().hex
    return env


def _marker_of(pid: int) -> str | None:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    for item in raw.split(b"\0"):
        if item.startswith(MARKER.encode() + b"="):
            return item.split(b"=", 1)[1].decode()
    return None


def find_processes(run_id: str | None) -> list[int]:
    """Pids carrying ``run_id`` (any run's, if None), excluding this process."""
    me = os.getpid()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        marker = _marker_of(int(entry.name))
        if marker is not None and (run_id is None or marker == run_id):
            pids.append(int(entry.name))
    return pids


def kill_run(run_id: str | None, grace_s: float = 10.0) -> list[int]:
    """SIGTERM the run's processes, SIGKILL what is left after ``grace_s``."""
    pids = find_processes(run_id)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline:
            pids = [p for p in pids if _alive(p)]
            if not pids:
                return []
            time.sleep(0.2)
    return pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kill", action="store_true", help="end every process of every rendezvous run")
    parser.add_argument("--run-id", help="only this run's processes")
    args = parser.parse_args()
    pids = find_processes(args.run_id)
    print(f"{len(pids)} process(es) of {'run ' + args.run_id if args.run_id else 'rendezvous runs'}: {pids}")
    if args.kill and pids:
        left = kill_run(args.run_id)
        print("all ended" if not left else f"still alive: {left}")


if __name__ == "__main__":
    main()
