"""``make serve``: run ``serve run CONFIG`` in the foreground and, however it ends
(Ctrl-C, SIGTERM, crash), end every process it started before returning."""

from __future__ import annotations

import signal
import subprocess
import sys

from app.procs import MARKER, kill_run, new_run_env


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

    def forward(signum, _frame):
        if child.poll() is None:
            child.send_signal(signal.SIGINT)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    try:
        code = child.wait()
    finally:
        try:  # serve run shuts Serve and Ray down on SIGINT; give it time before we sweep
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        left = kill_run(run_id)
        print(
            "[rendezvous] stopped; all processes ended" if not left else f"[rendezvous] could not end {left}",
            file=sys.stderr,
            flush=True,
        )
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
