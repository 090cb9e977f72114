"""app.tools.procs: finding a run's processes by their marker, and an app Serve gave up on (no app started)."""

from __future__ import annotations

import subprocess
import sys

import pytest

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


def _serve_details(**statuses: str) -> dict:
    """What Ray's dashboard answers on /api/serve/applications/, built with Serve's own schema."""
    from ray.serve.schema import ApplicationDetails, ServeInstanceDetails

    apps = {
        name: ApplicationDetails(name=name, route_prefix="/", docs_path=None, status=status, last_deployed_time_s=0,
                                 message="Traceback (most recent call last):\nImportError: cannot import name 'x'"
                                 if status == "DEPLOY_FAILED" else "", source="declarative", deployments={},
                                 external_scaler_enabled=False)
        for name, status in statuses.items()
    }
    return ServeInstanceDetails(proxies={}, applications=apps).model_dump(mode="json")


@pytest.mark.parametrize("statuses, failed", [
    ({}, None),
    ({"rendezvous": "DEPLOYING"}, None),
    ({"rendezvous": "RUNNING"}, None),
    ({"rendezvous": "DEPLOY_FAILED"}, "rendezvous"),
    ({"other": "RUNNING", "rendezvous": "DEPLOY_FAILED"}, "rendezvous"),
])
def test_an_app_serve_gave_up_on_is_named_with_why(statuses, failed):
    """procs.deploy_failure: `serve run` waits on forever when the app's code does not import; app.tools.run and
    the tests' AppProcess ask Serve's REST API and stop, saying why."""
    from app.tools.procs import deploy_failure

    said = deploy_failure(_serve_details(**statuses))
    if failed is None:
        assert said is None
    else:
        assert repr(failed) in said and "ImportError: cannot import name 'x'" in said


def test_the_deploy_failure_is_read_from_the_dashboard_over_http(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN", "t0k")
    import http.server
    import json
    import threading

    from app.tools.procs import read_deploy_failure

    body = json.dumps(_serve_details(rendezvous="DEPLOY_FAILED")).encode()

    class Dashboard(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # Ray 2.59+ asks local clients for its token
            ok = self.path == "/api/serve/applications/" and self.headers.get("Authorization") == "Bearer t0k"
            self.send_response(200 if ok else 404)
            self.end_headers()
            self.wfile.write(body if ok else b"{}")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Dashboard)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert "could not deploy application 'rendezvous'" in read_deploy_failure(url)
    finally:
        server.shutdown()
    assert read_deploy_failure(url) is None  # nothing listening: not a failure


def test_rays_token_is_found_where_rays_docs_say(tmp_path, monkeypatch):
    from app.tools.procs import ray_auth_headers

    monkeypatch.setenv("HOME", str(tmp_path))
    assert ray_auth_headers({}) == {}  # no token anywhere: ask without one
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("home\n")
    assert ray_auth_headers({}) == {"Authorization": "Bearer home"}
    (tmp_path / "elsewhere").write_text("file")
    assert ray_auth_headers({"RAY_AUTH_TOKEN_PATH": str(tmp_path / "elsewhere")}) == {"Authorization": "Bearer file"}
    assert ray_auth_headers({"RAY_AUTH_TOKEN": "env", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "elsewhere")}) == {
        "Authorization": "Bearer env"}
