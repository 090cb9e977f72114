"""Hold processes to a share of a core with a CPU cgroup, for as long as a test needs it.

A box that runs twice as slowly as the one a deadline was tuned on is the everyday case (this
one varies 2x from day to day); a CFS quota reproduces it on demand. cgroup v1's ``cpu``
controller where it is mounted (this machine class), else cgroup v2's. The cgroup is removed
and the processes put back where they were when the block ends, whatever happened in it.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path

_PERIOD_US = 100_000
_V1 = Path("/sys/fs/cgroup/cpu")
_V2 = Path("/sys/fs/cgroup/unified")


def _own_cgroup_v2(pid: int) -> Path:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return _V2 / line[3:].lstrip("/")
    raise RuntimeError(f"process {pid} is in no cgroup v2")


@contextlib.contextmanager
def cpu_quota(pids: list[int], cores: float) -> Iterator[Path]:
    """``pids`` (every thread of each) share ``cores`` of CPU time until the block ends."""
    assert pids, "no processes to hold"
    name = f"rendezvous-test-{uuid.uuid4().hex[:8]}"
    if (_V1 / "cgroup.procs").exists():
        group, back = _V1 / name, {pid: _V1 for pid in pids}
        group.mkdir()
        (group / "cpu.cfs_period_us").write_text(str(_PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(int(cores * _PERIOD_US)))
    elif "cpu" in (_V2 / "cgroup.controllers").read_text(errors="replace").split():
        back = {pid: _own_cgroup_v2(pid) for pid in pids}
        group = _V2 / name
        group.mkdir()
        (group / "cpu.max").write_text(f"{int(cores * _PERIOD_US)} {_PERIOD_US}")
    else:
        raise RuntimeError("no writable CPU cgroup controller (v1 cpu or v2 cpu) on this machine")
    try:
        for pid in pids:
            (group / "cgroup.procs").write_text(str(pid))
        yield group
    finally:
        for pid, parent in back.items():
            with contextlib.suppress(OSError):  # it may have exited
                (parent / "cgroup.procs").write_text(str(pid))
        with contextlib.suppress(OSError):
            group.rmdir()

