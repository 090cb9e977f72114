"""Changing the running app in place as an operator does, under a steady mix of requests.

``redeploy`` sends a changed config to the app's Ray with ``serve deploy`` (its dashboard on this host) and
waits until Serve reports the rollout done. ``SteadyTraffic`` keeps requests going meanwhile (whole and
streamed completions, a conversation's turns), each in its own thread, and keeps every outcome: an answer
(its prompt and output token ids, for teacher forcing), a refusal (status and Retry-After), a stream that
ended with an error event, or anything else (a cut connection, a hang), which a test counts as lost."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from app.tools.procs import BASE_URL, DASHBOARD_URL, deploy_failure, ray_auth_headers, serve_details
from tests.integration.cases import long_text

APP = "rendezvous"


def _app_details(app) -> dict:
    """Serve's view of the app that ``app`` (an AppProcess) runs, asked with its run's Ray token."""
    details = serve_details(env=app.env, timeout_s=30)
    assert details is not None, f"Ray's dashboard at {DASHBOARD_URL} did not answer"
    return details["applications"][APP]


def _rolled_out(details: dict, deployed_after: float) -> bool:
    """Serve has taken the config sent after ``deployed_after`` and every deployment runs its target, nothing else."""
    if details["last_deployed_time_s"] <= deployed_after or details["status"] != "RUNNING":
        return False
    for deployment in details["deployments"].values():
        states = [r["state"] for r in deployment["replicas"]]
        if deployment["status"] != "HEALTHY" or states != ["RUNNING"] * deployment["target_num_replicas"]:
            return False
    return True


def redeploy(app, config: str, timeout_s: float = 900) -> float:
    """``serve deploy config`` onto the app that ``app`` runs, as its operator would (with the run's environment:
    its Ray token); returns the seconds until the rollout was done."""
    before, started = _app_details(app)["last_deployed_time_s"], time.monotonic()
    serve = Path(sys.executable).with_name("serve")
    # Ray's CLI sends its token only where told that the cluster asks for one (Ray 2.59 turns it on by itself).
    env = {**app.env, **({"RAY_AUTH_MODE": "token"} if ray_auth_headers(app.env) else {})}
    done = subprocess.run([str(serve), "deploy", config, "--address", DASHBOARD_URL], timeout=120, capture_output=True,
                          text=True, env=env)
    assert done.returncode == 0, f"serve deploy {config}: {done.stderr[-2000:]}"
    while not _rolled_out(details := _app_details(app), before):
        assert (failure := deploy_failure({"applications": {APP: details}})) is None, failure
        assert time.monotonic() - started < timeout_s, f"the rollout of {config} is not done: {json.dumps(details)[:2000]}"
        time.sleep(2)
    return time.monotonic() - started


def replica_ids(app, deployment: str) -> set[str]:
    return {r["replica_id"] for r in _app_details(app)["deployments"][deployment]["replicas"]}


def deployment_named(app, prefix: str) -> str:
    return next(name for name in _app_details(app)["deployments"] if name.startswith(prefix))


def with_deployment_options(config: str, out: Path, **options_by_deployment: dict) -> str:
    """``config`` with Serve's per-deployment overrides (``applications[].deployments``), e.g. num_replicas:
    the options Serve changes in place, without a new code version."""
    raw = yaml.safe_load(Path(config).read_text())
    raw["applications"][0]["deployments"] = [{"name": name, **options} for name, options in options_by_deployment.items()]
    out.write_text(yaml.safe_dump(raw))
    return str(out)


@dataclass
class Outcome:
    kind: str  # "whole", "stream", "turn"
    status: int | None  # None: no status (the connection failed)
    prompt_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    retry_after: str | None = None
    error: str | None = None  # the error event of a stream, or what the client saw instead of an answer
    text: str = ""

    @property
    def answered(self) -> bool:
        return self.status == 200 and self.error is None and bool(self.token_ids)

    @property
    def retryable(self) -> bool:
        """Refused with a status a client retries (and says when), or a stream ended by an error event."""
        refused = self.status in (429, 503) and self.retry_after is not None
        return refused or (self.status == 200 and self.kind == "stream" and self.error is not None
                           and self.error.startswith("event:"))


class SteadyTraffic:
    """One thread per kind of request, each sending the next a second after the last ended, until stopped."""

    def __init__(self, conversation_prefix: str):
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._prefix = conversation_prefix
        self._threads = [threading.Thread(target=self._loop, args=(send,), daemon=True)
                         for send in (self._whole, self._stream, self._turn)]
        self._sent = 0
        self._conversation, self._messages = f"{conversation_prefix}-0", []

    def __enter__(self) -> "SteadyTraffic":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=300)
        assert not any(t.is_alive() for t in self._threads), "a request of the steady traffic hangs"

    def count(self, kind: str | None = None) -> int:
        with self._lock:
            return sum(1 for o in self.outcomes if kind is None or o.kind == kind)

    def _loop(self, send) -> None:
        with httpx.Client(base_url=BASE_URL, timeout=300) as http:
            while not self._stop.is_set():
                try:
                    outcome = send(http)
                except Exception as e:  # noqa: BLE001 - a cut connection, a timeout, a body that is no answer: lost
                    outcome = Outcome(send.__name__.strip("_"), None, error=repr(e))
                with self._lock:
                    self.outcomes.append(outcome)
                # As a client would: after a refusal, again when it says (a quick 503 is no reason to spin).
                time.sleep(min(float(outcome.retry_after), 5.0) if outcome.retry_after and outcome.retry_after.isdigit() else 1.0)

    def _next(self) -> int:
        with self._lock:
            self._sent += 1
            return self._sent

    def _whole(self, http: httpx.Client) -> Outcome:
        """A disaggregated completion (prefill leg and KV pushed), answered whole."""
        body = {"prompt": f"Request {self._next()}. {long_text(6)}\nWhich animal crossed river 4?", "max_tokens": 8,
                "temperature": 0, "return_token_ids": True}
        return _answer("whole", http.post("/v1/completions", json=body))

    def _stream(self, http: httpx.Client) -> Outcome:
        body = {"prompt": f"Stream {self._next()}. {long_text(6)}\nCount the rivers:", "max_tokens": 24,
                "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                return _answer("stream", r)
            prompt, tokens, error, done = [], [], None, False
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    error = "event: " + json.dumps(event["error"])
                    continue
                for choice in event.get("choices", []):
                    prompt = prompt or choice.get("prompt_token_ids") or []
                    tokens += choice.get("token_ids") or []
            if not done:
                error = (error or "") + " (no [DONE])"
            return Outcome("stream", 200, prompt, tokens, error=error)

    def _turn(self, http: httpx.Client) -> Outcome:
        """The next turn of a conversation (a new one every 8 turns, so its prompt stays short)."""
        if len(self._messages) > 16:
            self._conversation, self._messages = f"{self._prefix}-{self._next()}", []
        self._messages.append({"role": "user", "content": f"Turn {len(self._messages) // 2 + 1}. {long_text(2)} Which river?"})
        body = {"messages": self._messages, "max_tokens": 16, "temperature": 0, "return_token_ids": True,
                "conversation_id": self._conversation}
        outcome = _answer("turn", http.post("/v1/chat/completions", json=body))
        if outcome.answered:
            self._messages.append({"role": "assistant", "content": outcome.text})
        else:
            self._messages.pop()  # sent again as the next turn, as a client would retry it
        return outcome


def _answer(kind: str, r: httpx.Response) -> Outcome:
    if r.status_code != 200:
        return Outcome(kind, r.status_code, retry_after=r.headers.get("retry-after"), error=r.text[:300])
    payload = r.json()
    choice = payload["choices"][0]
    return Outcome(kind, 200, payload.get("prompt_token_ids") or choice.get("prompt_token_ids") or [],
                   choice.get("token_ids") or [], text=choice.get("text") or (choice.get("message") or {}).get("content") or "")
