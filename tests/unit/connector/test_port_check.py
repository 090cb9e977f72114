"""connector.port_check and app.tools.preflight: real sockets on this host, nothing else started."""

import os
import socket

import psutil
import pytest
import yaml

from app.tools.preflight import busy_ports, planned_ports, refusal
from connector.port_check import PortBusy, first_free_block, holder, is_free


def _listener(host="127.0.0.1") -> socket.socket:
    s = socket.socket()
    s.bind((host, 0))
    s.listen()
    return s


def test_a_listening_port_is_taken_and_its_holder_is_named():
    s = _listener()
    port = s.getsockname()[1]
    try:
        assert not is_free(port) and not is_free(port, "127.0.0.1")
        assert holder(port).startswith(f"pid {os.getpid()} (")
    finally:
        s.close()
    assert is_free(port)


def test_an_address_that_is_not_on_this_host_is_not_judged_taken():
    assert is_free(22000, "203.0.113.7")  # TEST-NET-3: the engine's own bind reports it


def test_the_first_free_block_is_taken_and_none_free_names_the_holder():
    taken, freed = _listener(), _listener()
    busy, free = taken.getsockname()[1], freed.getsockname()[1]
    freed.close()
    assert first_free_block([busy, free], 1, "127.0.0.1", what="x") == free
    with pytest.raises(PortBusy, match=rf"decode NIXL side-channel port 127.0.0.1:{busy} is held by pid {os.getpid()} .*make clean-procs"):
        first_free_block([busy], 1, "127.0.0.1", what="decode NIXL side-channel")
    with pytest.raises(PortBusy):  # a block of two (DP ranks) needs both free
        first_free_block([busy - 1], 2, "127.0.0.1", what="x")
    taken.close()
    assert first_free_block([busy], 1, "127.0.0.1", what="x") == busy


def _config(name: str) -> dict:
    return yaml.safe_load(open(f"configs/{name}.yaml"))


@pytest.mark.parametrize("config, args, expected", [
    ("local-cpu", None, [(8000, "HTTP (http_options.port)"), (20000, "prefill NIXL side channel"),
                         (22000, "decode NIXL side channel")]),
    ("local-cpu-1p2d", None, [(8000, "HTTP (http_options.port)"), (20000, "prefill NIXL side channel"),
                              (22000, "decode NIXL side channel"), (22001, "decode NIXL side channel")]),
    # Every replica a role may scale to, every DP rank; other bases; another HTTP port.
    ("local-cpu", {"http_options": {"port": 9000}, "prefill": {"replicas": 1, "engine_kwargs": {"data_parallel_size": 2}},
                   "decode": {"autoscaling": {"min_replicas": 1, "max_replicas": 2}},
                   "nixl": {"prefill_port_base": 30000, "decode_port_base": 33000}},
     [(9000, "HTTP (http_options.port)"), (30000, "prefill NIXL side channel"), (30001, "prefill NIXL side channel"),
      (33000, "decode NIXL side channel"), (33001, "decode NIXL side channel")]),
    # Not our builder (the aggregated baseline): only the HTTP port.
    ("local-cpu-aggregated", None, [(8000, "HTTP (http_options.port)")]),
])
def test_the_ports_a_config_binds(config, args, expected):
    raw = _config(config)
    if args:
        raw["http_options"] = {**raw["http_options"], **args.pop("http_options")}
        app_args = raw["applications"][0]["args"]
        for key, value in args.items():
            app_args[key] = {**app_args.get(key, {}), **value}
        if "autoscaling" in app_args["decode"]:
            app_args["decode"].pop("replicas", None)
    assert planned_ports(raw) == expected


def test_a_taken_port_is_refused_with_its_holder_and_the_way_out():
    s = _listener("0.0.0.0")
    port = s.getsockname()[1]
    try:
        raw = _config("local-cpu")
        raw["http_options"]["port"] = port
        raw["applications"][0]["args"]["nixl"] = {"prefill_port_base": 31000, "decode_port_base": 34000}
        busy = busy_ports(raw)
    finally:
        s.close()
    assert busy == [f"port {port}, HTTP (http_options.port): held by pid {os.getpid()} ({psutil.Process().name()})"]
    message = refusal("configs/local-cpu.yaml", busy)
    assert message.startswith("[rendezvous] cannot start configs/local-cpu.yaml") and "make clean-procs" in message


def test_make_serve_refuses_before_loading_vllm():
    """app.tools.run checks its ports first: the refusal is the first thing it prints, in a second, not after
    16 s of importing vLLM (whose import prints on stderr before it, as vLLM 0.32's Triton notice did)."""
    import subprocess
    import sys

    code = "import sys, app.tools.run; print(sorted(m for m in ('vllm', 'torch', 'ray') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]" and not out.stderr, out
