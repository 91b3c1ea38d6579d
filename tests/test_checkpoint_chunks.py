"""A flat range of a TP shard, as rectangles of the logical tensor: checked element by element
against the logical tensor itself (an arange, so every element names its own position)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_hydra.checkpoint.chunks import Chunks, Placement, rectangles


def _shard(logical: torch.Tensor, dim, tp: int, rank: int, padded_rows: int = 0) -> torch.Tensor:
    if padded_rows:  # a vocabulary table: padding rows (-1) beyond the logical ones
        logical = torch.cat([logical, -torch.ones(padded_rows - logical.shape[0], *logical.shape[1:])])
    return logical if dim is None else logical.chunk(tp, dim)[rank]


@pytest.mark.parametrize("shape,dim,tp,padded", [
    ((12, 10), 0, 2, 0), ((12, 10), 1, 2, 0), ((12, 10), None, 1, 0), ((30,), 0, 3, 0),
    ((10, 4), 0, 2, 16),  # 10 real rows padded to 16: rank 1 holds rows 8..15, two of them real
    ((5, 3, 2), 0, 1, 0),
])
def test_rectangles_cover_exactly_the_range(shape, dim, tp, padded):
    logical = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    for rank in range(tp):
        local = _shard(logical, dim, tp, rank, padded)
        place = Placement(tuple(shape), tuple(local.shape), 0 if padded else dim,
                          rank * local.shape[0 if padded else dim] if dim is not None else 0)
        flat = local.reshape(-1)
        row = math.prod(local.shape[1:])
        ranges = [(0, flat.numel()), (3, 17), (row, 3 * row), (1, 2)] if len(shape) < 3 else [(0, flat.numel()), (row, 3 * row)]
        for lo, hi in ranges:
            hi = min(hi, flat.numel())
            chunks = Chunks.of(place, flat[lo:hi], lo)
            seen = []
            for offsets, t in chunks.parts:
                window = logical[tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))]
                assert torch.equal(t, window), (offsets, t.shape)
                seen += t.reshape(-1).tolist()
            expected = [v for v in flat[lo:hi].tolist() if v >= 0]  # padding is not logical
            assert sorted(seen) == sorted(expected)
            assert all(t.data_ptr() >= flat.data_ptr() for t in chunks.local_tensors())  # views, no copies


def test_a_range_of_a_3d_tensor_must_be_whole_rows():
    with pytest.raises(ValueError, match="whole rows"):
        rectangles(Placement((4, 3, 2), (4, 3, 2)), 1, 7)
