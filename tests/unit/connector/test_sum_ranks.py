"""connector.sum_ranks: which TP sizes' sums pair, and which sender ranks make up a reader rank's.

The sums here are of a model block laid out as vLLM splits it (KV heads in contiguous chunks, in
rank order), so a reader's expected sums are checked against what its own blocks would hold."""

from __future__ import annotations

import numpy as np
import pytest

from connector.sum_ranks import expected_for_rank, parts_for, why_unpaired

HEADS, WORDS = 4, 6  # KV heads; int64 words one head takes in a block (one region, one block here)


def _rank_blocks(block: np.ndarray, tp: int) -> list[np.ndarray]:
    """Each rank's share of a [HEADS * WORDS] block: its heads, contiguous, in rank order."""
    return np.split(block, tp)


@pytest.mark.parametrize("sender_tp, reader_tp", [(1, 1), (2, 2), (4, 1), (1, 4), (2, 1), (1, 2), (4, 2), (2, 4)])
def test_a_reader_ranks_expected_sums_are_those_of_the_heads_it_holds(sender_tp, reader_tp):
    block = np.random.default_rng(sender_tp * 10 + reader_tp).integers(-2**62, 2**62, HEADS * WORDS, dtype=np.int64)
    parts = parts_for(sender_tp, reader_tp)
    by_rank = {r: share.reshape(1, 1, parts, -1).sum(axis=3) for r, share in enumerate(_rank_blocks(block, sender_tp))}
    for rank, held in enumerate(_rank_blocks(block, reader_tp)):
        expected, why_not = expected_for_rank(by_rank, sender_tp=sender_tp, reader_tp=reader_tp, reader_rank=rank)
        assert why_not is None and expected.shape == (1, 1)
        assert expected[0, 0] == held.sum()  # int64 wraps the same way on both sides


@pytest.mark.parametrize("sender_tp, reader_tp, heads, split, why", [
    (3, 3, 3, True, None), (3, 1, 3, True, None), (1, 3, 3, True, None), (2, 2, 1, False, None),
    (2, 3, 6, True, "neither divides"), (4, 1, 2, True, "above the model's 2 KV heads"),
    (2, 1, 8, False, "replicated"),
])
def test_which_tp_sizes_pair(sender_tp, reader_tp, heads, split, why):
    got = why_unpaired(sender_tp, reader_tp, heads, split)
    assert (got is None) if why is None else (why in got)


def test_a_missing_sender_rank_or_too_few_chunks_checks_nothing():
    sums = np.zeros((2, 3, 1), dtype=np.int64)
    assert "rank(s) [1]" in expected_for_rank({0: sums}, sender_tp=2, reader_tp=1, reader_rank=0)[1]
    assert "2 needed" in expected_for_rank({0: sums}, sender_tp=1, reader_tp=2, reader_rank=1)[1]
