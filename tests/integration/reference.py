"""A single aggregated vLLM engine, configured like the app's engines: the reference
that disaggregated answers must match (token for token, one request at a time) or
agree with under teacher forcing (concurrent requests; vLLM is not batch-invariant)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from app.config.llm_configs import CPU_DEFAULT_ENV
from app.model_source import resolve_model_source
from bench.reference import app_args
from connector.ports import Role


@dataclass(frozen=True)
class Generation:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str


class ReferenceEngine:
    """Greedy, one request at a time: the same request always gets the same answer, so
    each is computed once per session (the modules ask for the same cases)."""

    def __init__(self, config: str | Path):
        args = app_args(config)
        # The app's engine args and decode's environment, but a compute thread per core: the tests ask it while the
        # app is idle (before a step, or after it: teacher forcing is one batch of whole prompts), and one thread
        # left the box's other core idle. Its answers did not change with two (2026-12-06: the push package's and the
        # 1P2D module's token-identical checks passed), and every such check proves it again.
        os.environ.update({**CPU_DEFAULT_ENV, **args.decode.env, "OMP_NUM_THREADS": str(os.cpu_count() or 1)})
        from vllm import LLM

        kwargs = args.engine_kwargs_for(Role.DECODE)
        self.llm = LLM(model=resolve_model_source(args.model.source), **kwargs)
        self._answers: dict[str, Generation] = {}

    def close(self) -> None:
        # Explicitly, so the engine process does not log into closed pytest streams at exit.
        self.llm.llm_engine.engine_core.shutdown()

    def _params(self, max_tokens: int, **extra):
        from vllm import SamplingParams

        return SamplingParams(temperature=0.0, max_tokens=max_tokens, **extra)

    def complete(self, prompt: str | list[int], max_tokens: int) -> Generation:
        from vllm.inputs import TokensPrompt

        inp = TokensPrompt(prompt_token_ids=prompt) if isinstance(prompt, list) else prompt
        return self._answer(["complete", prompt, max_tokens], lambda: self.llm.generate([inp], self._params(max_tokens), use_tqdm=False))

    def chat(self, messages: list[dict], max_tokens: int, **extra) -> Generation:
        """``extra``: more sampling parameters (e.g. ``min_tokens``)."""
        return self._answer(
            ["chat", messages, max_tokens, extra], lambda: self.llm.chat([messages], self._params(max_tokens, **extra), use_tqdm=False)
        )

    def _answer(self, request: list, generate) -> Generation:
        key = json.dumps(request, sort_keys=True)
        if key not in self._answers:
            out = generate()[0]
            self._answers[key] = Generation(list(out.prompt_token_ids), list(out.outputs[0].token_ids), out.outputs[0].text)
        return self._answers[key]

    def teacher_forcing_gaps(self, pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """For each (prompt ids, generated ids) and each generated token, how many nats it
        lies below the reference's argmax when the reference reads prompt + generated
        tokens (0 = it is the argmax). One batch for all pairs."""
        from vllm.inputs import TokensPrompt

        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p + t) for p, t in pairs], self._params(1, prompt_logprobs=1), use_tqdm=False
        )
        all_gaps = []
        for (prompt_ids, token_ids), out in zip(pairs, outs):
            gaps = []
            for pos, token in enumerate(token_ids, start=len(prompt_ids)):
                candidates = out.prompt_logprobs[pos]
                best = max(lp.logprob for lp in candidates.values())
                gaps.append(best - candidates[token].logprob)
            all_gaps.append(gaps)
        return all_gaps
