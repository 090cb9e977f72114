"""GCS fault tolerance's store for ``python -m app.tools.cluster up --gcs-ft``: Redis in a namespace of its own
(``cluster_plan.RedisHost``), and whether a config would outlive a head restart at all."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import yaml

from app.config.args import AppArgs
from app.tools.cluster_plan import RedisHost, in_namespace
from app.tools.procs import REPO
from deploy.resilience import serve_head_restart_errors

REDIS_TOOL = REPO / ".tools" / "redis" / "usr" / "bin" / "redis-server"  # where `make redis` unpacks Debian's


def redis_server() -> tuple[str, dict[str, str]]:
    """The redis-server binary and the environment it needs (its unpacked libraries, for ``make redis``'s)."""
    if REDIS_TOOL.exists():
        libs = sorted(str(p) for p in (REDIS_TOOL.parents[1] / "lib").glob("*-linux-gnu"))
        return str(REDIS_TOOL), {"LD_LIBRARY_PATH": ":".join(libs)}
    if found := shutil.which("redis-server"):
        return found, {}
    raise RuntimeError("GCS fault tolerance needs redis-server: `make redis` unpacks Debian's into .tools/redis "
                       "(or apt-get install redis-server)")


def start_redis(redis: RedisHost, env: dict[str, str], password: str) -> None:
    """Redis in its own namespace, configured by ``RedisHost.config``; returns once it answers."""
    binary, binary_env = redis_server()
    data = Path(redis.data_dir)
    data.mkdir(mode=0o700, parents=True, exist_ok=True)
    conf = data / "redis.conf"
    fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds the password
    with os.fdopen(fd, "w") as f:
        f.write(redis.config(password))
    subprocess.Popen(in_namespace(redis.namespace, [binary, str(conf)]), env={**env, **binary_env}, cwd=data,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 20
    while not redis_answers(redis.address, password):
        if time.monotonic() > deadline:
            log = data / "redis.log"
            raise RuntimeError(f"Redis did not answer at {redis.address} in 20 s:\n"
                               f"{log.read_text()[-2000:] if log.exists() else '(no log)'}")
        time.sleep(0.2)


def redis_answers(address: str, password: str) -> bool:
    """Whether Redis at ``address`` takes the password and answers PING (RESP, inline commands)."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=2) as s:
            s.sendall(f"AUTH {password}\r\nPING\r\n".encode())
            reply = b""
            while reply.count(b"\r\n") < 2:
                if not (chunk := s.recv(256)):
                    break
                reply += chunk
    except OSError:
        return False
    return reply == b"+OK\r\n+PONG\r\n"


def ft_config_problem(config: str) -> str | None:
    """Why ``config`` would not outlive a head restart, or None (the rules deploy.checks applies on Kubernetes)."""
    serve_config = yaml.safe_load(Path(config).read_text()) or {}
    args = AppArgs.model_validate(serve_config["applications"][0].get("args") or {})
    problems = serve_head_restart_errors(serve_config, args)
    return "; ".join(problems) if problems else None
