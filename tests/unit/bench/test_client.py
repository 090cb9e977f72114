"""bench/client.py: the seam to vLLM's benchmark client."""

from __future__ import annotations

import dataclasses


def test_load_arguments_are_ones_vllms_benchmark_accepts(tmp_path):
    from bench.client import Load, parse_args

    load = Load("http://h:8000/", "/tok", 512, 0.5, 6, 64, model="m", result_path=tmp_path / "r.json")
    args = parse_args(load.argv())
    assert (args.backend, args.base_url, args.endpoint) == ("openai", "http://h:8000", "/v1/completions")
    assert (args.dataset_name, args.random_input_len, args.random_output_len) == ("random", 512, 64)
    assert (args.num_prompts, args.request_rate, args.ignore_eos, args.temperature) == (6, 0.5, True, 0.0)
    assert args.metric_percentiles == "50,90,99" and args.percentile_metrics == "ttft,tpot,itl,e2el"
    assert args.save_result and args.result_dir == str(tmp_path) and args.result_filename == "r.json"
    assert args.num_warmups == 0 and args.model == "m" and args.tokenizer == "/tok"
    chat = parse_args(dataclasses.replace(load, backend="openai-chat", result_path=None).argv())
    assert chat.endpoint == "/v1/chat/completions" and not chat.save_result
