"""``make serve``: run ``serve run CONFIG`` in the foreground and, however it ends
(Ctrl-C, SIGTERM, crash), end every process it started before returning."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from app.procs import MARKER, kill_run, new_run_env

_RESEND_SIGINT_S = 20
_STOP_GRACE_S = 60


def main(argv: list[str]) -> int:
    config = argv[0] if argv else "configs/local-cpu.yaml"
    env = new_run_env(keep_existing=True)
    run_id = env[MARKER]
    print(f"[rendezvous] serve run {config} (run id {run_id}); Ctrl-C stops everything", file=sys.stderr, flush=True)
    # Own session, so a terminal's Ctrl-C reaches serve run once, through us.
    child = subprocess.Popen(
        [sys.executable, "-m", "ray.serve.scripts", "run", config, *argv[1:]],
        env=env,
        start_new_session=True,
    )

    stop_requested_at: list[float] = []

    def forward(signum, _frame):
        if not stop_requested_at:
            stop_requested_at.append(time.monotonic())
            print(f"[rendezvous] stopping ({signal.Signals(signum).name})", file=sys.stderr, flush=True)
        if child.poll() is None:
            child.send_signal(signal.SIGINT)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    try:
        code = _wait_for(child, stop_requested_at)
    finally:
        left = kill_run(run_id)
        print(
            "[rendezvous] stopped; all processes ended" if not left else f"[rendezvous] could not end {left}",
            file=sys.stderr,
            flush=True,
        )
    return code


def _wait_for(child: subprocess.Popen, stop_requested_at: list[float]) -> int:
    """The child's exit code. Once a stop was asked for, serve run gets SIGINT again every
    few seconds (it shuts Serve and Ray down on it) and at most ``_STOP_GRACE_S`` in all;
    then the caller's sweep ends whatever is left."""
    while True:
        try:
            return child.wait(timeout=_RESEND_SIGINT_S)
        except subprocess.TimeoutExpired:
            if not stop_requested_at:
                continue
            if time.monotonic() - stop_requested_at[0] > _STOP_GRACE_S:
                return -signal.SIGINT
            child.send_signal(signal.SIGINT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
