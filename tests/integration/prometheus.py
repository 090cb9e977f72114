"""A real Prometheus server (Debian's, unpacked by `make install` into .tools/) scraping a running app's
Ray metrics export, with the alert rules loaded: what the dashboard and the alerts see, asked through
Prometheus's HTTP API. Started on a free loopback port with its data in a temporary folder; ended (and
waited for) when the context ends."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import yaml

from tests.observability import TOOLS_BIN

SERVER = TOOLS_BIN / "prometheus"
SCRAPE_S = 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    def __init__(self, url: str):
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=30)

    def query(self, expr: str) -> list[dict]:
        """The instant vector ``expr`` gives now; fails on a query Prometheus refuses."""
        r = self.http.get("/api/v1/query", params={"query": expr})
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
        return body["data"]["result"]

    def alerting_rules(self) -> list[dict]:
        return [rule for group in self.http.get("/api/v1/rules").json()["data"]["groups"] for rule in group["rules"]
                if rule["type"] == "alerting"]

    def scrapes(self) -> int:
        """Samples scraped from the app's target so far (its ``up`` series' count over the last hour)."""
        result = self.query('count_over_time(up{job="ray"}[1h])')
        return int(float(result[0]["value"][1])) if result else 0


@contextlib.contextmanager
def prometheus_scraping(metrics_url: str, data_dir: Path, rule_files: tuple[Path, ...] = ()):
    if not SERVER.exists():
        raise RuntimeError(f"{SERVER} is missing: `make install` unpacks Debian's prometheus package there")
    target = urlsplit(metrics_url)
    port = _free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    config = data_dir / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
        "rule_files": [str(path) for path in rule_files],
        "scrape_configs": [{"job_name": "ray", "metrics_path": target.path or "/metrics",
                            "static_configs": [{"targets": [target.netloc]}]}],
    }))
    log = open(data_dir / "prometheus.log", "w")
    server = subprocess.Popen(
        [str(SERVER), f"--config.file={config}", f"--storage.tsdb.path={data_dir / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--web.enable-lifecycle"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        prometheus = Prometheus(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if prometheus.http.get("/-/ready").status_code == 200:
                    break
            assert server.poll() is None and time.monotonic() < deadline, (data_dir / "prometheus.log").read_text()[-3000:]
            time.sleep(0.5)
        yield prometheus
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
