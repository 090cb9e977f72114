"""app.tools.run: what `make serve` runs."""

from __future__ import annotations

import pytest

from app.tools.run import serve_run_argv


def _address(argv: list[str]) -> str | None:
    """The address serve run's click parser ends up with: an option's last value wins."""
    address = None
    for i, arg in enumerate(argv):
        if arg in ("--address", "-a"):
            address = argv[i + 1]
        elif arg.startswith("--address="):
            address = arg.split("=", 1)[1]
    return address


@pytest.mark.parametrize("extra, env, address", [
    ([], {}, "local"),  # a `ray start` left on the host must not be joined
    ([], {"RAY_ADDRESS": "10.0.0.1:6379"}, None),  # deploying onto a cluster, as app.tools.cluster does: serve run reads it
    (["--address", "10.0.0.1:6379"], {}, "10.0.0.1:6379"),
    (["-a", "10.0.0.1:6379"], {}, "10.0.0.1:6379"),
    (["--address=auto"], {}, "auto"),
])
def test_serve_run_starts_a_ray_of_its_own_unless_told_where(extra, env, address):
    argv = serve_run_argv("configs/local-cpu.yaml", extra, env)
    assert argv[argv.index("run"):][:2] == ["run", "configs/local-cpu.yaml"]
    assert _address(argv) == address
