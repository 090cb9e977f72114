"""``python -m app.tools.drill head|gcs``: on a running cluster with GCS fault tolerance (``python -m
app.tools.cluster up --gcs-ft``), keep a steady trickle of requests going, take the head (every process of its
node) or only its GCS process away for ``--down-s`` seconds, bring it back (the head with the same Redis; the
GCS as it was started), and report what the traffic and the engines saw: requests answered and failed, the
outage (from the first failed request to the next answer), whether any engine process was replaced, and how
long after the return Serve's controller reported every replica healthy again. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from app.tools.cluster import kill_node, namespace_pids, rejoin, running_plan
from app.tools.cluster_plan import ClusterPlan, NodeKind, in_namespace
from app.tools.metrics_text import metric_lines
from app.tools.procs import process_environ, process_name, running

ENGINE_PROCESS = "VLLM::EngineCor"  # vLLM's engine core process title, as /proc/<pid>/comm cuts it
PROMPT = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
HTTP_PORT = 8000


@dataclass
class Outcome:
    started: float  # monotonic seconds
    ended: float
    ok: bool
    detail: str  # the answer's text, or why it failed


@dataclass
class DrillReport:
    what: str  # "head" or "gcs"
    down_s: float  # how long it was away
    requests: int
    answered: int
    failed: int
    wrong: int  # answered, with a text other than the first answer's (greedy: all must agree)
    outage_s: float  # first failed request's start to the next answer's end; 0 if none failed
    engines_restarted: bool
    controller_back_s: float | None  # from the return to every replica reported healthy; None: not within the wait
    failures: list[str] = field(default_factory=list)  # the distinct reasons, at most 5


class Trickle:
    """One request after another, ``gap_s`` apart, against ``base_url``, until ``stop``."""

    def __init__(self, base_url: str, gap_s: float = 0.2, timeout_s: float = 60):
        self.outcomes: list[Outcome] = []
        self._client = httpx.Client(base_url=base_url, timeout=timeout_s)
        self._gap_s, self._stopping = gap_s, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Trickle":
        self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._stopping.set()
        self._thread.join()
        self._client.close()

    def _run(self) -> None:
        while not self._stopping.is_set():
            started = time.monotonic()
            try:
                r = self._client.post("/v1/completions", json=PROMPT)
                ok = r.status_code == 200
                detail = r.json()["choices"][0]["text"] if ok else f"{r.status_code} {r.text[:120]}"
            except (httpx.HTTPError, ValueError, KeyError) as e:
                ok, detail = False, f"{type(e).__name__}: {e}"[:160]
            self.outcomes.append(Outcome(started, time.monotonic(), ok, detail))
            self._stopping.wait(self._gap_s)


@dataclass(frozen=True)
class SavedProcess:
    """A process's command line, environment and working directory, to start the same again."""

    argv: list[str]
    env: dict[str, str]
    cwd: str


def kill_gcs(plan: ClusterPlan) -> SavedProcess:
    """SIGKILL the head's GCS process alone (as a crash would), after saving how it was started. Outside
    Kubernetes nothing restarts it: ``start_gcs`` does."""
    found = [pid for pid in running(namespace_pids([plan.head.namespace])) if process_name(pid) == "gcs_server"]
    if len(found) != 1:
        raise RuntimeError(f"expected one gcs_server in {plan.head.namespace}, found {found}")
    pid = found[0]
    proc = Path(f"/proc/{pid}")
    saved = SavedProcess(
        argv=[a.decode() for a in proc.joinpath("cmdline").read_bytes().split(b"\0") if a],
        env=process_environ(pid),
        cwd=os.readlink(proc / "cwd"),
    )
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while running([pid]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return saved


def start_gcs(plan: ClusterPlan, saved: SavedProcess) -> int:
    """Start the head's GCS again as it was (``kill_gcs``): it reloads the cluster's state from Redis. Its pid."""
    if not plan.gcs_ft:
        raise RuntimeError("without GCS fault tolerance a new GCS starts empty: the cluster is lost")
    child = subprocess.Popen(in_namespace(plan.head.namespace, saved.argv), env=saved.env, cwd=saved.cwd,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    return child.pid


def engine_pids(plan: ClusterPlan) -> set[int]:
    """The vLLM engine core processes of the prefill and decode nodes."""
    pids = namespace_pids([plan.node(k).namespace for k in (NodeKind.PREFILL, NodeKind.DECODE)])
    return {pid for pid in running(pids) if process_name(pid) == ENGINE_PROCESS}


_HEALTHY = "ray_serve_deployment_replica_healthy"


def all_replicas_healthy(plan: ClusterPlan) -> bool:
    """Whether Serve's controller (on the head) reports every replica of the app healthy, and at least one."""
    try:
        text = metric_lines(plan.metrics_url(NodeKind.HEAD), _HEALTHY, timeout_s=5)  # polled through the outage
    except httpx.HTTPError:
        return False
    health = [sample.value for family in text_string_to_metric_families(text) for sample in family.samples
              if sample.name == _HEALTHY]
    return bool(health) and all(v == 1 for v in health)


def outage_s(outcomes: list[Outcome]) -> float:
    """From the first failed request's start to the end of the first answer after the last failure (or the
    last request's end, if none came)."""
    failed = [i for i, o in enumerate(outcomes) if not o.ok]
    if not failed:
        return 0.0
    after = next((o for o in outcomes[failed[-1] + 1:] if o.ok), outcomes[-1])
    return after.ended - outcomes[failed[0]].started


def run_drill(plan: ClusterPlan, what: str, down_s: float = 10, after_s: float = 30, settle_s: float = 3,
              controller_wait_s: float = 120) -> DrillReport:
    """Take the head (``what="head"``) or its GCS (``"gcs"``) away for ``down_s`` under a trickle of requests,
    bring it back, keep the trickle ``after_s`` more (at least until the controller is back or
    ``controller_wait_s`` ran out), and report."""
    if not plan.gcs_ft:
        raise RuntimeError("the cluster has no GCS fault tolerance (python -m app.tools.cluster up --gcs-ft)")
    engines = engine_pids(plan)
    if not engines:
        raise RuntimeError("no vLLM engine process on the prefill or decode node: is the app running?")
    with Trickle(plan.base_url(HTTP_PORT)) as trickle:
        time.sleep(settle_s)
        if what == "head":
            kill_node(plan, NodeKind.HEAD)
        else:
            saved = kill_gcs(plan)
        time.sleep(down_s)
        if what == "head":
            rejoin(plan, NodeKind.HEAD)
        else:
            start_gcs(plan, saved)
        back = time.monotonic()
        controller_back_s = None
        while time.monotonic() - back < max(after_s, controller_wait_s):
            if controller_back_s is None and all_replicas_healthy(plan):
                controller_back_s = round(time.monotonic() - back, 1)
            if controller_back_s is not None and time.monotonic() - back >= after_s:
                break
            time.sleep(1)
    outcomes = trickle.outcomes
    answers = [o.detail for o in outcomes if o.ok]
    failures = list(dict.fromkeys(o.detail for o in outcomes if not o.ok))
    return DrillReport(
        what=what, down_s=down_s, requests=len(outcomes), answered=len(answers),
        failed=len(outcomes) - len(answers), wrong=sum(a != answers[0] for a in answers),
        outage_s=round(outage_s(outcomes), 1), engines_restarted=engine_pids(plan) != engines,
        controller_back_s=controller_back_s, failures=failures[:5],
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.tools.drill", description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["head", "gcs"], help="the whole head node, or only its GCS process")
    parser.add_argument("--down-s", type=float, default=10, help="how long it stays away (default 10)")
    parser.add_argument("--after-s", type=float, default=30, help="traffic after its return (default 30)")
    parser.add_argument("--prefix", default="rdv")
    args = parser.parse_args(argv)
    try:
        report = run_drill(running_plan(args.prefix), args.what, args.down_s, args.after_s)
    except RuntimeError as e:
        print(f"[rendezvous] drill {args.what}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(asdict(report), indent=2))
    return 0 if report.failed == 0 and report.wrong == 0 and not report.engines_restarted else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
