"""Each context-parallel rank's share of every sample (``parallel.context_parallel_size``).

Under context parallelism the ``cp`` ranks of a data-parallel rank receive the same samples, and
each keeps its two chunks of every sequence: of the ``2 cp`` equal chunks, rank ``i`` keeps chunks
``i`` and ``2 cp - 1 - i`` (``parallel.context_parallel.shard_sequence``), so that every rank has
the same share of the causal attention's work. Tokens, labels and the loss mask are cut alike, and
the batch gains ``position_ids``: the positions of the kept tokens in their sequence, which rotary
and learned position embeddings read instead of ``0, 1, ...`` (positions that restart at each
document, ``data.reset_position_ids``, are cut alike). ``document_ids`` (packed documents) are cut
alike too; the attention all-gathers them (``parallel.context_parallel``).

The cut happens in the DataLoader (``ShardingCollate``), so a rank copies to its device only what
it computes on. The loss stays the mean over every unmasked token of the whole sequence: each
rank's share is reduced against the whole sequence's token count (``models.archs.masked_mean``).
"""

from __future__ import annotations

from typing import Dict, List

import torch
from torch.utils.data import default_collate

from megatron_hydra.parallel.context_parallel import shard_sequence


def shard_batch(batch: Dict[str, torch.Tensor], cp_size: int, cp_rank: int) -> Dict[str, torch.Tensor]:
    """This context-parallel rank's chunks of every ``[samples, seq]`` field of ``batch`` (the
    fields as long as ``tokens``), with ``position_ids`` added when the batch has none. The batch
    itself when ``cp_size`` is 1."""
    if cp_size == 1:
        return batch
    samples, seq = batch["tokens"].shape[:2]
    if "position_ids" not in batch:
        positions = torch.arange(seq, device=batch["tokens"].device)
        batch = dict(batch, position_ids=positions.expand(samples, seq))
    return {k: shard_sequence(v, 1, cp_size, cp_rank) if v.dim() >= 2 and v.shape[1] == seq else v
            for k, v in batch.items()}


class ShardingCollate:
    """The DataLoader's ``collate_fn``: stack the samples, then keep this rank's chunks
    (``shard_batch``). A class, so that DataLoader workers can pickle it."""

    def __init__(self, cp_size: int, cp_rank: int):
        self.cp_size, self.cp_rank = cp_size, cp_rank

    def __call__(self, samples: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
        return shard_batch(default_collate(samples), self.cp_size, self.cp_rank)
