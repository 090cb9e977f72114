"""app.tools.procs through psutil: ending processes, engines under a replica, CPU seconds and the
``python -m app.tools.procs`` command, on processes these tests start (no app, no Ray)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import psutil
import pytest

from app.tools.procs import (MARKER, OTHERS_GRACE_S, _cmdline, cpu_seconds, engine_processes, find_processes, kill, new_run_env,
                             running)

PYTHON = sys.executable


def wait_until(predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not (result := predicate()):
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.05)
    return result


def zombie() -> subprocess.Popen:
    """A child that exited and that we have not reaped yet."""
    proc = subprocess.Popen(["true"])
    wait_until(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE)
    return proc


@pytest.fixture
def started():
    """Start processes in their own sessions; end them (by process group) afterwards."""
    procs: list[subprocess.Popen] = []

    def start(args, **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(args, start_new_session=True, **kwargs)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def test_kill_ends_a_process_with_sigterm(started):
    sleeper = started(["sleep", "30"])
    t0 = time.monotonic()
    assert kill([sleeper.pid], grace_s=10) == []
    assert time.monotonic() - t0 < 5  # it was a zombie of ours at once: counted as ended
    assert sleeper.wait(timeout=5) == -signal.SIGTERM


def test_kill_falls_back_to_sigkill_after_the_grace_period(started):
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(30)"
    stubborn = started([PYTHON, "-c", code], stdout=subprocess.PIPE, text=True)
    assert stubborn.stdout.readline().strip() == "ready"
    t0 = time.monotonic()
    assert kill([stubborn.pid], grace_s=0.5) == []
    assert 0.5 <= time.monotonic() - t0 < 5
    assert stubborn.wait(timeout=5) == -signal.SIGKILL


def _ignoring_sigterm(started, name: str) -> subprocess.Popen:
    """A process named ``name`` (what ``ps`` and psutil show, as vLLM names its engines) that ignores SIGTERM."""
    code = ("import ctypes, signal, sys, time; ctypes.CDLL(None).prctl(15, sys.argv[1].encode(), 0, 0, 0); "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(30)")
    proc = started([PYTHON, "-c", code, name], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_only_an_engine_gets_the_whole_grace_ray_s_daemons_and_the_rest_are_sigkilled_soon(started):
    """vLLM's engines shut down on SIGTERM; Ray's raylet takes 10 s on it and its GCS ignores it: waiting for
    them was most of a cluster's Ctrl-C."""
    daemon, engine = _ignoring_sigterm(started, "gcs_server"), _ignoring_sigterm(started, "VLLM::EngineCore")
    t0 = time.monotonic()
    assert kill([daemon.pid], grace_s=10) == []
    assert OTHERS_GRACE_S <= time.monotonic() - t0 < OTHERS_GRACE_S + 3
    assert daemon.wait(timeout=5) == -signal.SIGKILL
    t0 = time.monotonic()
    assert kill([engine.pid], grace_s=2 * OTHERS_GRACE_S + 1) == []
    assert time.monotonic() - t0 >= 2 * OTHERS_GRACE_S + 1
    assert engine.wait(timeout=5) == -signal.SIGKILL


def test_kill_counts_gone_and_zombie_processes_as_ended():
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = zombie()
    try:
        t0 = time.monotonic()
        assert kill([gone.pid, dead.pid], grace_s=10) == []
        assert time.monotonic() - t0 < 1
    finally:
        dead.wait()


def test_cmdline_of_a_live_a_zombie_and_a_gone_process(started):
    sleeper = started(["sleep", "30"])
    wait_until(lambda: psutil.Process(sleeper.pid).cmdline() == ["sleep", "30"])  # exec'd
    assert _cmdline(sleeper.pid) == "sleep 30"
    dead = zombie()
    try:
        assert _cmdline(dead.pid) == ""
    finally:
        dead.wait()
    assert _cmdline(dead.pid) == "?"


def test_cpu_seconds_counts_live_processes_only():
    before = cpu_seconds([os.getpid()])
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    assert cpu_seconds([os.getpid()]) >= before + 0.04
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert cpu_seconds([gone.pid]) == 0.0
    assert cpu_seconds([]) == 0.0


# A "replica" (its command line as Ray titles a Serve replica) whose children name themselves
# as vLLM's engine processes do; the engine's own child too. /proc/self/comm is the name.
ENGINE = textwrap.dedent("""
    import subprocess, sys, time
    open("/proc/self/comm", "w").write(sys.argv[1])
    if len(sys.argv) > 2:
        subprocess.Popen([sys.executable, __file__, *sys.argv[2:]])
    time.sleep(30)
""")


def replica(started, tmp_path, title: str, *children: list[str]) -> subprocess.Popen:
    script = tmp_path / "engine.py"
    script.write_text(ENGINE)
    spawn = " ".join(f"'{PYTHON}' '{script}' {' '.join(names)} &" for names in children)
    return started(["bash", "-c", f'exec -a "{title}" bash -c "{spawn} wait"'])


def names_of(pids):
    return sorted(psutil.Process(p).name()[:15] for p in pids)


def test_engine_processes_are_the_vllm_processes_under_the_deployments_replicas(started, tmp_path):
    # Deployment names of our own: a real app may be running on this box.
    tag = uuid.uuid4().hex[:8]
    prefill_name, decode_name = f"PrefillT{tag}", f"DecodeT{tag}"
    replica(started, tmp_path, f"ray::ServeReplica:app:{prefill_name}", ["VLLM::EngineCore", "VLLM::Worker_TP0"], ["helper"])
    replica(started, tmp_path, f"ray::ServeReplica:app:{decode_name}", ["VLLM::EngineCore"])
    started([PYTHON, "-c", ENGINE, "VLLM::EngineCore"])  # under no replica

    prefill = wait_until(lambda: len(names_of(engine_processes(prefill_name))) == 2 and engine_processes(prefill_name))
    assert names_of(prefill) == ["VLLM::EngineCor", "VLLM::Worker_TP"]  # comm keeps 15 characters
    decode = wait_until(lambda: engine_processes(decode_name))
    assert names_of(decode) == ["VLLM::EngineCor"] and not set(decode) & set(prefill)
    assert engine_processes(f"NothingT{tag}") == []


# What setproctitle (Ray's processes) does to /proc/<pid>/environ: NULs over its first entries.
TITLED = textwrap.dedent("""
    import ctypes, time
    environ = ctypes.POINTER(ctypes.c_void_p).in_dll(ctypes.CDLL(None), "environ")
    first = environ[0]
    ctypes.memset(first, 0, len(ctypes.string_at(first)))
    print("ready", flush=True)
    time.sleep(30)
""")


def test_a_run_finds_a_process_whose_environment_block_starts_with_nuls(started):
    env = new_run_env({"A_FIRST": "x" * 64, "PATH": os.environ["PATH"]})
    assert next(iter(env)) == "A_FIRST"
    titled = started([PYTHON, "-c", TITLED], env=env, stdout=subprocess.PIPE, text=True)
    assert titled.stdout.readline().strip() == "ready"
    with open(f"/proc/{titled.pid}/environ", "rb") as f:
        assert f.read().startswith(b"\0" * 64)
    assert find_processes(env[MARKER]) == [titled.pid]


def test_the_command_ends_only_the_given_runs_processes(started):
    env = new_run_env()
    ours = started(["sleep", "30"], env=env)
    other = started(["sleep", "30"], env=new_run_env())
    out = subprocess.run(
        [PYTHON, "-m", "app.tools.procs", "--kill", "--run-id", env[MARKER]], env=env, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"1 process(es): [{ours.pid}]", "all ended"]
    assert ours.wait(timeout=5) == -signal.SIGTERM
    assert other.poll() is None


def test_running_leaves_out_zombies_and_the_gone():
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    while running([zombie.pid]):  # exited, not yet reaped: a zombie
        pass
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert running([os.getpid(), zombie.pid, gone.pid]) == [os.getpid()]
    zombie.wait()
