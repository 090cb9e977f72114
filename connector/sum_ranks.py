"""KV sums between engines of different tensor parallel sizes (pure numpy; no vLLM, no Ray).

vLLM splits each (layer region, block) between TP ranks along the KV-head dimension, in equal
contiguous chunks in rank order: a rank of the bigger TP holds chunk ``rank % k`` of the block of
rank ``rank // k`` of the smaller TP, ``k`` being the ratio of the sizes (``_build_fa_remote``
offsets a READ or WRITE by ``rank_offset_factor`` chunks; ``_build_local_splits_from_plan`` fills
chunk ``fa_slot`` of a bigger block from each smaller one; seams in ``connector.seams``).

A block's sum (its int64 words, wrapping: numpy and torch both do) is the sum of its chunks'
sums, and so is its digest (connector.kv_checksum: a weighed sum of its regions' sums, linear too). So a reader rank that holds the heads of ``k`` sender ranks expects the sum of their ``k``
block sums, and a reader rank that holds a ``1/k`` chunk of a sender rank's block expects that
chunk's sum, which the sender must have summed apart: it sums every block in ``parts_for(...)``
chunks. Equal TP sizes are the case ``k = 1``, with nothing to add and no chunk to cut.

Not covered (``why_unpaired`` says so): TP sizes neither of which divides the other (vLLM cannot
move KV between them, and app.config.args refuses them), more ranks than KV heads (ranks then share heads
and vLLM reads each head once), and MLA, whose latent is the same on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


def parts_for(sender_tp: int, reader_tp: int) -> int:
    """Chunks a sender rank sums each block in: as many reader ranks as share one of its blocks."""
    return max(1, reader_tp // max(sender_tp, 1))


def why_unpaired(sender_tp: int, reader_tp: int, kv_heads: int, split_heads: bool = True) -> str | None:
    """Why sums cannot be paired between these TP sizes, or None if they can."""
    if sender_tp == reader_tp:
        return None
    if not split_heads:
        return f"the KV is replicated on every rank (MLA), TP {sender_tp} and {reader_tp}"
    big, small = max(sender_tp, reader_tp), min(sender_tp, reader_tp)
    if small < 1 or big % small:
        return f"TP {sender_tp} and {reader_tp}: neither divides the other"
    if big > kv_heads:
        return f"TP {big} is above the model's {kv_heads} KV heads (ranks share heads)"
    return None


def sender_ranks(sender_tp: int, reader_tp: int, reader_rank: int) -> range:
    """The sender ranks whose sums a reader rank's expected sums are made of."""
    if reader_tp <= sender_tp:
        k = sender_tp // reader_tp
        return range(reader_rank * k, reader_rank * k + k)
    rank = reader_rank // (reader_tp // sender_tp)
    return range(rank, rank + 1)


def expected_for_rank(by_rank: Mapping[int, np.ndarray], *, sender_tp: int, reader_tp: int,
                      reader_rank: int) -> tuple[np.ndarray | None, str | None]:
    """A reader rank's expected [regions, blocks] sums from the senders' [regions, blocks, parts]
    sums by sender rank (only the ranks it reads from are needed), or (None, why not)."""
    ranks = sender_ranks(sender_tp, reader_tp, reader_rank)
    missing = [r for r in ranks if r not in by_rank]
    if missing:
        return None, f"no sums from sender rank(s) {missing}"
    if reader_tp <= sender_tp:
        shapes = {by_rank[r].shape[:2] for r in ranks}
        if len(shapes) != 1:
            return None, f"sender ranks summed different shapes {sorted(shapes)}"
        return np.sum([by_rank[r].sum(axis=2) for r in ranks], axis=0, dtype=np.int64), None
    k = reader_tp // sender_tp
    sums = by_rank[ranks[0]]
    parts = sums.shape[2]
    if parts % k:
        return None, f"the sender summed {parts} chunk(s) a block, {k} needed"
    width, j = parts // k, reader_rank % k
    return sums[:, :, j * width:(j + 1) * width].sum(axis=2, dtype=np.int64), None
