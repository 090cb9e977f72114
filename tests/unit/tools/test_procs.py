"""app.tools.procs: finding a run's processes by their marker (no app started)."""

from __future__ import annotations

import subprocess
import sys

from app.tools.procs import MARKER, new_run_env


def test_a_run_never_finds_itself_or_its_ancestors():
    """`make serve` carries the run's marker like app.tools.run does; app.tools.run's sweep must not kill it."""
    env = new_run_env()
    probe = f"from app.tools.procs import find_processes; print(find_processes({env[MARKER]!r}))"
    # sh (the ancestor, like make) and python (the sweeper) both carry the marker.
    out = subprocess.run(
        ["sh", "-c", f'"{sys.executable}" -c "{probe}"; true'], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out


def test_a_run_finds_its_other_processes():
    env = new_run_env()
    sleeper = subprocess.Popen(["sleep", "30"], env=env)
    try:
        probe = f"from app.tools.procs import find_processes; print(find_processes({env[MARKER]!r}))"
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == f"[{sleeper.pid}]", out
    finally:
        sleeper.kill()
        sleeper.wait()


def test_runs_start_in_the_repository_root():
    """AppProcess starts every run there (configs are relative paths), wherever the tools module sits."""
    from app.tools.procs import REPO

    assert (REPO / "pyproject.toml").is_file() and (REPO / "configs" / "local-cpu.yaml").is_file()
