"""KV digests: one int64 word a block, of the bytes NIXL moves (pure torch and numpy; no vLLM, no Ray).

A block's digest is the sum of its layer regions' int64 sums of bytes, each times an odd 64-bit weight of its
region (:func:`region_weights`), all wrapping. One word a block, not one a (layer region, block): a 16k-token
request's digests on a GPU's 16-token blocks are 8 KiB a rank, where the sums of a 64-layer model's 128 K and V
regions were 1 MiB. The digest is linear, like the sums: chunks' and ranks' digests add up to a block's
(connector.sum_ranks). A change to one region's bytes that changes its sum changes the digest (an odd weight is
invertible modulo 2**64); changes in several regions that cancel out would go unseen, which the weights make as
unlikely as a 64-bit collision for anything but an adversary. A permutation of words inside one region's block is
not seen (a sum is order-blind).

A few runs of consecutive block ids are summed in place (the bytes read once, never copied); more than
:data:`MAX_RUNS` take one gather and one sum per region: a warm engine hands a request blocks freed in reverse
order, and a sum per run made a 16k-token request on a GPU's 16-token blocks ~65k tiny ops per rank
(docs/results/kv-checksum-gpu-geometry.json). Who digests what, and when, is connector.kv_checksum's.
"""

from __future__ import annotations

import numpy as np

MAX_RUNS = 8  # runs of consecutive block ids summed one by one; more are gathered


def digest_job(regions: list, block_ids, parts: int = 1) -> DigestJob | None:
    """Start the [1, len(block_ids), parts] digests of each block's ``parts`` equal chunks (the KV heads of as many
    ranks of a bigger TP), over ``regions`` (per layer region a [blocks, words] int64 view); None if a block's words
    do not split into ``parts`` equal chunks."""
    import torch

    if any(region.shape[1] % parts for region in regions):
        return None
    ids = list(block_ids)
    device = regions[0].device
    if not ids:
        return DigestJob.of(lambda: torch.zeros((1, 0, parts), dtype=torch.int64), device)
    runs = _runs(ids)

    def digests():
        if len(runs) <= MAX_RUNS:
            sums = torch.stack([torch.cat([region[start:start + n].reshape(n, parts, -1).sum(dim=2)
                                           for start, n in runs]) for region in regions])
        else:
            index = torch.as_tensor(ids, dtype=torch.long, device=device)
            sums = torch.stack([region.index_select(0, index).reshape(len(ids), parts, -1).sum(dim=2)
                                for region in regions])
        return (sums * region_weights(len(regions), device).view(-1, 1, 1)).sum(dim=0, keepdim=True)

    return DigestJob.of(digests, device)


class DigestJob:
    """Digests on their way to the host. On a GPU they are computed on a side stream (ordered after the
    work already queued on the engine's stream) and copied to pinned memory, so a hook on the step
    loop's thread never waits for the device: it asks :meth:`ready` at each step instead. Elsewhere
    (CPU, or a device without streams) they are computed at once."""

    def __init__(self, host, event=None, keep=None):
        self._host, self._event, self._keep = host, event, keep

    @classmethod
    def of(cls, compute, device) -> DigestJob:
        import torch

        if getattr(device, "type", "cpu") != "cuda":
            return cls(compute())
        stream = _SIDE_STREAMS.get(device)
        if stream is None:
            stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            digests = compute()
            host = torch.empty(digests.shape, dtype=digests.dtype, pin_memory=True)
            host.copy_(digests, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return cls(host, event, keep=digests)

    def ready(self) -> bool:
        return self._event is None or bool(self._event.query())

    def result(self) -> np.ndarray:
        """The digests, [1, blocks, parts] int64 (waits for the device if they are not ready)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.numpy()


_SIDE_STREAMS: dict = {}  # device -> the stream digests are computed on
_WEIGHTS: dict = {}  # (regions, device) -> region_weights
_MASK = (1 << 64) - 1


def region_weights(regions: int, device):
    """One odd 64-bit weight a layer region (as int64), the same on every engine: splitmix64 of its index."""
    import torch

    key = (regions, str(device))
    if key not in _WEIGHTS:
        words = []
        for index in range(regions):
            z = (index * 0x9E3779B97F4A7C15 + 0x9E3779B97F4A7C15) & _MASK
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
            word = (z ^ (z >> 31)) | 1
            words.append(word - (1 << 64) if word >= 1 << 63 else word)
        _WEIGHTS[key] = torch.tensor(words, dtype=torch.int64, device=device)
    return _WEIGHTS[key]


def _runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """(start, length) of each run of consecutive ids, in order: [4, 5, 6, 2, 3] -> [(4, 3), (2, 2)]."""
    runs: list[tuple[int, int]] = []
    for block in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block, 1))
    return runs
