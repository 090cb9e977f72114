"""AppArgs.parse: the app's whole configuration surface, and every shipped config file."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from app.config.args import Accelerator, AppArgs, IngressArgs, ModelArgs, NixlArgs, RoleArgs
from connector.params import TransferMode
from connector.ports import PortPlan, Role

REPO = Path(__file__).resolve().parents[3]
CONFIG_FILES = sorted((REPO / "configs").glob("*.yaml"))


def parse_error(raw) -> str:
    """Parse ``raw``, expect our ValueError (not pydantic's), return its message."""
    with pytest.raises(ValueError) as excinfo:
        AppArgs.parse(raw)
    # pydantic's ValidationError is a ValueError too; parse must have translated it.
    assert not isinstance(excinfo.value, ValidationError), "parse leaked pydantic's ValidationError"
    message = str(excinfo.value)
    assert message.startswith("invalid rendezvous app args:"), message
    return message


def get(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


# --------------------------------------------------------------------------- defaults


@pytest.mark.parametrize(
    "path, expected",
    [
        ("model.id", "SmolLM2-135M-Instruct"),
        ("model.source", "embedded"),
        ("mode", TransferMode.PUSH),
        ("accelerator", Accelerator.CPU),
        ("engine_kwargs", {}),
        ("prefill.replicas", 1),
        ("prefill.engine_kwargs", {}),
        ("prefill.cpus", 0.5),
        ("prefill.gpus", 0),
        ("prefill.env", {}),
        ("prefill.max_ongoing_requests", 64),
        ("decode.replicas", 1),
        ("decode.engine_kwargs", {}),
        ("decode.cpus", 0.5),
        ("decode.gpus", 0),
        ("decode.env", {}),
        ("decode.max_ongoing_requests", 64),
        ("nixl.backends", ["UCX"]),
        ("nixl.prefill_port_base", 20000),
        ("nixl.decode_port_base", 22000),
        ("nixl.extra_config", {}),
        ("ingress.replicas", 1),
        ("ingress.cpus", 0.1),
        ("ingress.max_ongoing_requests", 256),
    ],
)
def test_defaults(path, expected):
    assert get(AppArgs.parse({}), path) == expected


def test_none_and_empty_give_the_same_defaults_and_an_instance_passes_through():
    assert AppArgs.parse(None) == AppArgs.parse({})
    args = AppArgs.parse({"mode": "pull"})
    assert AppArgs.parse(args) is args


def test_default_port_plan_is_portplans_default():
    assert AppArgs.parse({}).nixl.port_plan() == PortPlan()


def test_args_are_frozen():
    args = AppArgs.parse({})
    with pytest.raises(ValidationError):
        args.mode = TransferMode.PULL  # type: ignore[misc]


def test_role_picks_the_roles_section():
    args = AppArgs.parse({"prefill": {"replicas": 2}, "decode": {"replicas": 3}})
    assert args.role(Role.PREFILL).replicas == 2
    assert args.role(Role.DECODE).replicas == 3


# --------------------------------------------------------------------------- unknown keys


@pytest.mark.parametrize(
    "raw, where, model, must_list",
    [
        ({"bogus": 1}, "bogus", AppArgs, ["model", "mode", "accelerator", "engine_kwargs", "prefill", "decode", "nixl", "ingress"]),
        ({"model": {"name": "x"}}, "model.name", ModelArgs, ["id", "source"]),
        ({"prefill": {"replica": 2}}, "prefill.replica", RoleArgs, ["replicas", "engine_kwargs", "cpus", "gpus", "env", "max_ongoing_requests"]),
        ({"decode": {"gpu": 1}}, "decode.gpu", RoleArgs, ["gpus", "replicas"]),
        ({"nixl": {"backend": ["UCX"]}}, "nixl.backend", NixlArgs, ["backends", "prefill_port_base", "decode_port_base", "extra_config"]),
        ({"ingress": {"cpu": 1}}, "ingress.cpu", IngressArgs, ["replicas", "cpus", "max_ongoing_requests"]),
    ],
)
def test_unknown_key_names_the_key_and_lists_the_valid_ones(raw, where, model: type[BaseModel], must_list):
    message = parse_error(raw)
    line = next((l for l in message.splitlines() if l.strip().startswith(f"{where}:")), None)
    assert line is not None, f"no line names {where!r}:\n{message}"
    assert "unknown key" in line
    listed = line.split("valid keys here:", 1)[1].strip().split(", ")
    assert listed == sorted(model.model_fields), line
    assert set(must_list) <= set(listed)


def test_every_problem_gets_its_own_line():
    message = parse_error({"bogus": 1, "prefill": {"replica": 2}, "mode": "sideways"})
    lines = message.splitlines()[1:]
    assert len(lines) == 3, message
    assert any(l.strip().startswith("bogus: unknown key") for l in lines)
    assert any(l.strip().startswith("prefill.replica: unknown key") for l in lines)
    assert any(l.strip().startswith("mode:") for l in lines)


def test_free_form_dicts_accept_any_key():
    args = AppArgs.parse(
        {
            "engine_kwargs": {"anything_vllm_takes": 1},
            "prefill": {"engine_kwargs": {"whatever": True}, "env": {"FI_PROVIDER": "efa"}},
            "nixl": {"extra_config": {"kv_lease_duration": 60}},
        }
    )
    assert args.engine_kwargs == {"anything_vllm_takes": 1}
    assert args.prefill.env == {"FI_PROVIDER": "efa"}
    assert args.nixl.extra_config == {"kv_lease_duration": 60}


# --------------------------------------------------------------------------- wrong types / values


@pytest.mark.parametrize(
    "raw, where, fragment",
    [
        ({"prefill": {"replicas": "two"}}, "prefill.replicas", "valid integer"),
        ({"prefill": {"replicas": 2.5}}, "prefill.replicas", "valid integer"),
        ({"prefill": {"replicas": 0}}, "prefill.replicas", "greater than or equal to 1"),
        ({"decode": {"cpus": 0}}, "decode.cpus", "greater than 0"),
        ({"decode": {"cpus": "lots"}}, "decode.cpus", "valid number"),
        ({"decode": {"gpus": -1}}, "decode.gpus", "greater than or equal to 0"),
        ({"decode": {"max_ongoing_requests": 0}}, "decode.max_ongoing_requests", "greater than or equal to 1"),
        ({"prefill": {"env": {"A": 1}}}, "prefill.env.A", "valid string"),
        ({"prefill": {"env": ["A=1"]}}, "prefill.env", "valid dictionary"),
        ({"engine_kwargs": []}, "engine_kwargs", "valid dictionary"),
        ({"decode": {"engine_kwargs": "x"}}, "decode.engine_kwargs", "valid dictionary"),
        ({"mode": "bogus"}, "mode", "'push' or 'pull'"),
        ({"accelerator": "tpu"}, "accelerator", "'cpu', 'gpu' or 'neuron'"),
        ({"nixl": {"backends": "UCX"}}, "nixl.backends", "valid list"),
        ({"nixl": {"backends": []}}, "nixl.backends", "at least 1 item"),
        ({"nixl": {"prefill_port_base": "low"}}, "nixl.prefill_port_base", "valid integer"),
        ({"model": {"id": 7}}, "model.id", "valid string"),
        ({"model": "SmolLM2"}, "model", "valid dictionary"),
        ({"ingress": {"replicas": 0}}, "ingress.replicas", "greater than or equal to 1"),
        ("not a mapping", "<root>", "valid dictionary"),
    ],
)
def test_wrong_types_and_values_are_refused(raw, where, fragment):
    message = parse_error(raw)
    assert f"  {where}: " in message, message
    assert fragment in message, message


@pytest.mark.parametrize(
    "raw, path, expected",
    [
        ({"prefill": {"replicas": "2"}}, "prefill.replicas", 2),
        ({"decode": {"cpus": 2}}, "decode.cpus", 2.0),
        ({"mode": "pull"}, "mode", TransferMode.PULL),
        ({"accelerator": "gpu", "prefill": {"gpus": 1}, "decode": {"gpus": 2}}, "accelerator", Accelerator.GPU),
    ],
)
def test_values_that_pydantic_may_coerce(raw, path, expected):
    assert get(AppArgs.parse(raw), path) == expected


# --------------------------------------------------------------------------- gpus and accelerator


@pytest.mark.parametrize(
    "raw, error",
    [
        ({}, None),
        ({"accelerator": "cpu", "prefill": {"gpus": 0}, "decode": {"gpus": 0}}, None),
        ({"prefill": {"gpus": 1}}, "prefill.gpus must be 0 with accelerator 'cpu'"),
        ({"decode": {"gpus": 2}}, "decode.gpus must be 0 with accelerator 'cpu'"),
        ({"accelerator": "gpu"}, "prefill.gpus must be at least 1 with accelerator 'gpu'"),
        ({"accelerator": "gpu", "prefill": {"gpus": 1}}, "decode.gpus must be at least 1 with accelerator 'gpu'"),
        ({"accelerator": "gpu", "decode": {"gpus": 1}}, "prefill.gpus must be at least 1 with accelerator 'gpu'"),
        ({"accelerator": "gpu", "prefill": {"gpus": 1}, "decode": {"gpus": 1}}, None),
        ({"accelerator": "gpu", "prefill": {"gpus": 2}, "decode": {"gpus": 4}}, None),
    ],
)
def test_gpus_follow_the_accelerator(raw, error):
    if error is None:
        args = AppArgs.parse(raw)
        for role in Role:
            gpus = args.role(role).gpus
            assert gpus == 0 if args.accelerator is Accelerator.CPU else gpus >= 1
    else:
        assert error in parse_error(raw)


# --------------------------------------------------------------------------- kv_transfer_config


@pytest.mark.parametrize(
    "raw, role",
    [
        ({"engine_kwargs": {"kv_transfer_config": {"kv_connector": "NixlConnector"}}}, "prefill"),
        ({"prefill": {"engine_kwargs": {"kv_transfer_config": {}}}}, "prefill"),
        ({"decode": {"engine_kwargs": {"kv_transfer_config": None}}}, "decode"),
    ],
)
def test_kv_transfer_config_in_engine_kwargs_is_refused(raw, role):
    message = parse_error(raw)
    assert f"{role}.engine_kwargs: kv_transfer_config" in message
    assert "do not set it" in message


@pytest.mark.parametrize(
    "raw, fragment",
    [
        ({"conversations": {"pull_history": "upstream"}}, "needs mode: pull"),  # push is the default mode
        ({"mode": "pull", "conversations": {"pull_history": "upstream", "enabled": False}}, "needs mode: pull and conversations.enabled"),
        ({"mode": "pull", "nixl": {"extra_config": {"bidirectional_kv_xfer": True}}}, "set conversations.pull_history: upstream"),
        ({"mode": "pull", "conversations": {"pull_history": "upstream"}, "nixl": {"extra_config": {"decoder_kv_blocks_ttl": 9}}},
         "is conversations.retention_s"),
        # Upstream's conversation knobs do nothing in push or are overwritten: ours say it.
        ({"nixl": {"extra_config": {"decoder_kv_blocks_ttl": 480}}}, "is conversations.retention_s"),
        ({"nixl": {"extra_config": {"kv_recompute_threshold": 64}}}, "set conversations.recompute_threshold"),
        ({"conversations": {"pull_history": "sometimes"}}, "pull_history"),
    ],
)
def test_pull_history_is_checked_against_mode_and_upstream_knobs(raw, fragment):
    assert fragment in parse_error(raw)


def test_pull_history_upstream_in_pull_mode_is_accepted():
    args = AppArgs.parse({"mode": "pull", "conversations": {"pull_history": "upstream"}})
    assert args.upstream_pull_history


# --------------------------------------------------------------------------- side-channel ports


@pytest.mark.parametrize(
    "prefill_base, decode_base, ok",
    [
        (20000, 22000, True),
        (22000, 20000, True),  # order does not matter, distance does
        (1024, 3024, True),  # lowest allowed
        (30000, 63536, True),  # decode's span ends exactly at 65535
        (20000, 21999, False),
        (21000, 22000, False),
        (20000, 20000, False),
        (500, 5000, False),  # below 1024
        (64000, 20000, False),  # prefill's span would pass 65535
    ],
)
def test_colliding_or_out_of_range_port_bases_are_refused(prefill_base, decode_base, ok):
    raw = {"nixl": {"prefill_port_base": prefill_base, "decode_port_base": decode_base}}
    if ok:
        plan = AppArgs.parse(raw).nixl.port_plan()
        assert (plan.prefill_base, plan.decode_base) == (prefill_base, decode_base)
    else:
        message = parse_error(raw)
        assert "  nixl: " in message and "side-channel" in message, message


@pytest.mark.parametrize(
    "raw, ok",
    [
        ({"prefill": {"replicas": 2000}}, True),
        ({"prefill": {"replicas": 2001}}, False),
        ({"decode": {"replicas": 2000}}, True),
        ({"decode": {"replicas": 2001}}, False),
        ({"decode": {"replicas": 1000, "engine_kwargs": {"data_parallel_size": 2}}}, True),
        ({"decode": {"replicas": 1001, "engine_kwargs": {"data_parallel_size": 2}}}, False),
        # DP size from the shared engine kwargs counts for both roles.
        ({"engine_kwargs": {"data_parallel_size": 4}, "prefill": {"replicas": 501}}, False),
        ({"engine_kwargs": {"data_parallel_size": 4}, "prefill": {"replicas": 500}, "decode": {"replicas": 500}}, True),
        # ... unless the role overrides it.
        ({"engine_kwargs": {"data_parallel_size": 4}, "prefill": {"replicas": 1000, "engine_kwargs": {"data_parallel_size": 1}}}, True),
    ],
)
def test_replicas_must_fit_in_the_port_span(raw, ok):
    if ok:
        assert AppArgs.parse(raw)
    else:
        assert "does not fit" in parse_error(raw)


# --------------------------------------------------------------------------- engine_kwargs_for


@pytest.mark.parametrize(
    "shared, prefill, decode, want_prefill, want_decode",
    [
        ({}, {}, {}, {}, {}),
        ({"max_model_len": 4096}, {}, {}, {"max_model_len": 4096}, {"max_model_len": 4096}),
        (
            {"max_model_len": 4096, "enforce_eager": True},
            {"max_model_len": 2048},
            {"block_size": 32},
            {"max_model_len": 2048, "enforce_eager": True},
            {"max_model_len": 4096, "enforce_eager": True, "block_size": 32},
        ),
        ({"enforce_eager": True}, {"enforce_eager": False}, {}, {"enforce_eager": False}, {"enforce_eager": True}),
    ],
)
def test_engine_kwargs_for_merges_shared_and_role_with_role_winning(shared, prefill, decode, want_prefill, want_decode):
    args = AppArgs.parse({"engine_kwargs": shared, "prefill": {"engine_kwargs": prefill}, "decode": {"engine_kwargs": decode}})
    assert args.engine_kwargs_for(Role.PREFILL) == want_prefill
    assert args.engine_kwargs_for(Role.DECODE) == want_decode
    # Merging builds a new dict; the parsed args are left alone.
    merged = args.engine_kwargs_for(Role.PREFILL)
    merged["scribble"] = 1
    assert "scribble" not in args.engine_kwargs and "scribble" not in args.prefill.engine_kwargs
    assert args.engine_kwargs == shared


# --------------------------------------------------------------------------- shipped config files


def test_there_are_config_files():
    assert CONFIG_FILES, "configs/*.yaml is empty"


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_config_file_parses(path: Path):
    config = yaml.safe_load(path.read_text())
    applications = config["applications"]
    assert applications, f"{path.name}: no applications"
    app = applications[0]
    # The disaggregated app, or the benchmarks' aggregated baseline over the same args.
    assert app["import_path"] in ("app.builder:build_app", "app.aggregated:build_aggregated_app"), path.name
    args = AppArgs.parse(app.get("args"))
    assert isinstance(args, AppArgs)
    # What the file says is what we got (the parse did not drop anything silently).
    raw = app.get("args") or {}
    if "mode" in raw:
        assert args.mode is TransferMode(raw["mode"])
    for role in ("prefill", "decode"):
        if "replicas" in raw.get(role, {}):
            assert args.role(Role(role)).replicas == raw[role]["replicas"]


@pytest.mark.parametrize("prefill_tp, decode_tp, ok", [
    (1, 1, True), (3, 1, True), (1, 3, True), (2, 4, True), (4, 2, True), (2, 3, False), (6, 4, False),
])
def test_prefill_and_decode_tp_sizes_must_divide_one_another(prefill_tp, decode_tp, ok):
    raw = {role: {"engine_kwargs": {"tensor_parallel_size": tp}} for role, tp in (("prefill", prefill_tp), ("decode", decode_tp))}
    if ok:
        assert AppArgs.parse(raw)
    else:
        with pytest.raises(ValueError, match=rf"\({prefill_tp} and {decode_tp}\): one must divide the other"):
            AppArgs.parse(raw)
