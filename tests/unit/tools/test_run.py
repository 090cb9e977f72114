"""app.tools.run: what `make serve` runs."""

from __future__ import annotations

import pytest

from app.tools.run import serve_run_argv


@pytest.mark.parametrize("extra, env, local", [
    ([], {}, True),  # a `ray start` left on the host must not be joined
    ([], {"RAY_ADDRESS": "10.0.0.1:6379"}, False),  # deploying onto a cluster, as app.tools.cluster does
    (["--address", "10.0.0.1:6379"], {}, False),
    (["--address=auto"], {}, False),
])
def test_serve_run_starts_a_ray_of_its_own_unless_told_where(extra, env, local):
    argv = serve_run_argv("configs/local-cpu.yaml", extra, env)
    assert argv[argv.index("run"):][:2] == ["run", "configs/local-cpu.yaml"]
    assert (argv[-2:] == ["--address", "local"]) is local
    assert argv.count("--address") + sum(a.startswith("--address=") for a in argv) == (1 if local or extra else 0)
