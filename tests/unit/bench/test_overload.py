"""bench/overload.py: goodput under overload, and the arms' configs and clients (no app, no engines)."""

from __future__ import annotations

from pathlib import Path

import yaml

from bench.profiles import load_config


def test_overload_counts_goodput_as_complete_answers_within_the_slo_that_the_client_still_waited_for():
    from bench.overload import Outcome, OverloadLoad, summarize

    load = OverloadLoad(slo_s=10.0, seconds=20.0)

    def outcome(status, ttft, latency, abandoned=False):
        return Outcome("adaptive", 2.0, 0, 0.0, status, ttft, latency, abandoned, None)

    row = summarize([
        outcome(200, 2.0, 6.0), outcome(200, 9.0, 14.0),  # good
        outcome(200, 12.0, 16.0),  # answered, but its first byte missed the SLO
        outcome(200, 25.0, 30.0, abandoned=True),  # the client gave up mid-stream: 30 s the server spent for nobody
        outcome(0, None, 30.0, abandoned=True),  # given up on before any answer: not an error of the server
        outcome(429, None, 0.05), outcome(429, None, 0.2), outcome(503, None, 20.0),
    ], load)
    assert row["goodput_rps"] == 2 / 20.0 and row["answered"] == 3 and row["abandoned_in_flight_s"] == 60.0
    assert row["answered_in_time"] == 2
    assert (row["rejected_429"], row["rejection_p99_s"], row["expired_503"]) == (2, 0.2, 1)
    assert (row["ttft_p50_s"], row["ttft_p99_s"], row["other_status"]) == (12.0, 25.0, [])


def test_overload_arms_differ_only_in_admission(tmp_path):
    from bench.overload import OverloadLoad, _arm_config

    from app.config.args import AppArgs

    load = OverloadLoad(slo_s=7.0, queue_deadline_s=14.0)
    configs = [yaml.safe_load(Path(_arm_config("configs/local-cpu.yaml", arm, load, tmp_path)).read_text())
               for arm in ("fixed", "adaptive", "whole", "as-is")]
    ingress = [AppArgs.model_validate(c["applications"][0]["args"]).ingress for c in configs]
    assert (ingress[0].ttft_slo_s, ingress[0].queue_deadline_s) == (None, None)
    assert (ingress[1].ttft_slo_s, ingress[1].queue_deadline_s) == (7.0, 14.0)
    assert ingress[2] == ingress[1], "the whole-answer arm runs the adaptive arm's app"
    assert ingress[3] == AppArgs.model_validate(load_config("configs/local-cpu.yaml")["applications"][0]["args"]).ingress
    assert ingress[0].max_in_flight == ingress[1].max_in_flight


def test_the_whole_answer_arm_is_not_streamed_and_its_client_waits_only_the_slo():
    import random

    from bench.overload import OverloadLoad, _body, _patience_s

    load = OverloadLoad(slo_s=7.0, client_timeout_s=30.0)
    assert _body("m", load, random.Random(0), 1, stream=False)["stream"] is False
    assert (_patience_s(load, "whole"), _patience_s(load, "adaptive")) == (7.0, 30.0)
