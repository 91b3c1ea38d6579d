"""Sliding-window and soft-capped attention under context parallelism (ring p2p and Ulysses a2a).

The reference is a naive float64 attention over the whole sequence written here (scores, tanh
cap, causal / window / document mask, softmax), with autograd for the gradients; each rank
compares its shard of it (``shard_sequence``) with what ``context_parallel_attention`` gives from
the sharded inputs, to 1e-10. One spawn of 4 ranks runs every case at cp4 and, on the pairs
{0, 1} and {2, 3}, at cp2; it also counts the ring's block kernels to see the window skip blocks.
"""

from __future__ import annotations

import pytest
import torch

from megatron_hydra.parallel import block_attention as B
from megatron_hydra.parallel.context_parallel import context_parallel_attention, shard_sequence
from conftest import spawn_ranks

BATCH, HEADS, GROUPS, HEAD_DIM, CHUNK = 2, 4, 2, 4, 4  # sequence = 2 * cp * CHUNK
TOL = 1e-10


def _cases(cp: int):
    """(comm_type, causal, window, softcap, documents, scale) for a sequence of 2 cp CHUNK."""
    seq = 2 * cp * CHUNK
    for comm in ("p2p", "a2a"):
        yield comm, True, CHUNK - 1, None, False, None  # within a chunk: tiles cut by it, empty rows
        yield comm, True, 2 * CHUNK + 3, None, False, 0.3  # spans several chunks
        yield comm, True, 1, None, False, None  # each query sees itself only
        yield comm, True, seq, None, False, None  # reaches every key: no window
        yield comm, True, None, 0.8, False, 0.5  # cap alone
        yield comm, True, CHUNK + 1, 0.8, False, None
        yield comm, True, CHUNK + 2, None, True, None  # window and documents
        yield comm, True, 3, 0.7, True, 0.4
        yield comm, False, CHUNK + 3, 0.9, False, None  # no causality: i - j < w only


def _inputs(seq: int):
    gen = torch.Generator().manual_seed(99 + seq)
    q, k, v, dout = (torch.randn(BATCH, n, seq, HEAD_DIM, generator=gen, dtype=torch.float64)
                     for n in (HEADS, GROUPS, GROUPS, HEADS))
    starts = torch.tensor([[3, 9, 11, 16, 25], [1, 8, 14, 20, 31]])  # documents crossing chunk edges
    ids = torch.stack([torch.bucketize(torch.arange(seq), row, right=True) for row in starts])
    return q, k, v, dout, ids


def _reference(q, k, v, causal, window, softcap, ids, scale):
    """Attention over the whole sequence, every step spelled out (kv heads repeated for GQA)."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    s = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    i, j = torch.arange(q.shape[2]).unsqueeze(-1), torch.arange(k.shape[2]).unsqueeze(0)
    keep = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool)
    if causal:
        keep &= j <= i
    if window is not None:
        keep &= i - j < window
    keep = keep.expand(q.shape[0], 1, -1, -1)
    if ids is not None:
        keep = keep & (ids.unsqueeze(-1) == ids.unsqueeze(-2)).unsqueeze(1)
    return torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ v


def _check(case, group, rank: int, cp: int):
    """Max abs errors of out, dq, dk, dv on this rank."""
    comm, causal, window, softcap, documents, scale = case
    q, k, v, dout, ids = _inputs(2 * cp * CHUNK)
    ids = ids if documents else None
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _reference(*full, causal, window, softcap, ids, scale)
    ref.backward(dout)
    local = [shard_sequence(t, 2, cp, rank).requires_grad_() for t in (q, k, v)]
    local_ids = None if ids is None else shard_sequence(ids, 1, cp, rank)
    out = context_parallel_attention(*local, group, comm, causal, scale, local_ids, window=window, softcap=softcap)
    out.backward(shard_sequence(dout, 2, cp, rank))
    return [float((got - shard_sequence(want, 2, cp, rank)).abs().max())
            for got, want in zip([out.detach()] + [t.grad for t in local], [ref.detach()] + [t.grad for t in full])]


def _count_tiles(group, rank: int, cp: int, window):
    """(forward, backward) block kernel calls of one ring attention on this rank."""
    from megatron_hydra.parallel import context_parallel as CP

    calls = {"forward": 0, "backward": 0}

    def counted(name, kernel):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return kernel(*args, **kwargs)
        return wrapper

    forward, backward = CP.attention_with_lse, CP.attention_with_lse_backward
    CP.attention_with_lse, CP.attention_with_lse_backward = counted("forward", forward), counted("backward", backward)
    try:
        _check(("p2p", True, window, None, False, None), group, rank, cp)
    finally:
        CP.attention_with_lse, CP.attention_with_lse_backward = forward, backward
    return calls["forward"], calls["backward"]


def _worker(rank: int, world: int):
    import torch.distributed as dist

    everyone = dist.new_group(list(range(world)))
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    results = {(4, case): _check(case, everyone, rank, 4) for case in _cases(4)}
    results.update({(2, case): _check(case, pairs[rank // 2], rank % 2, 2) for case in _cases(2)})
    results["tiles"] = {window: _count_tiles(everyone, rank, 4, window) for window in (None, CHUNK - 1)}
    return results


@pytest.fixture(scope="module")
def results():
    return spawn_ranks(_worker, 4)


@pytest.mark.parametrize("cp", [2, 4])
def test_window_and_softcap_match_naive_attention(results, cp):
    assert sorted(results) == [0, 1, 2, 3]
    for rank, per_case in results.items():
        for case in _cases(cp):
            assert max(per_case[(cp, case)]) < TOL, (rank, cp, case, per_case[(cp, case)])


def _needed_chunk_pairs(rank: int, cp: int, window: int) -> int:
    """(local query chunk, key chunk) pairs in which some query sees some key, counted naively
    from the global positions of every query and key."""
    chunk_positions = [range(c * CHUNK, (c + 1) * CHUNK) for c in range(2 * cp)]
    return sum(any(j <= i and i - j < window for i in chunk_positions[a] for j in chunk_positions[b])
               for a in (rank, 2 * cp - 1 - rank) for b in range(2 * cp))


def test_ring_skips_blocks_outside_the_window(results):
    for rank, per_case in results.items():
        tiles = per_case["tiles"]
        assert tiles[None] == (4, 4), rank  # no window: one block per ring step, as ever
        needed = _needed_chunk_pairs(rank, 4, CHUNK - 1)
        causal_pairs = sum(b <= a for a in (rank, 7 - rank) for b in range(8))
        assert tiles[CHUNK - 1] == (needed, needed), (rank, tiles)
        assert needed < causal_pairs, rank  # the window masks some pairs that causality keeps


def test_one_rank_window_and_softcap():
    q, k, v, _, ids = _inputs(12)
    for window, softcap, documents in ((5, None, False), (None, 0.6, False), (3, 0.6, True)):
        doc = ids if documents else None
        out = context_parallel_attention(q, k, v, None, "p2p", True, None, doc, window=window, softcap=softcap)
        assert (out - _reference(q, k, v, True, window, softcap, doc, None)).abs().max() < TOL


def test_capped_block_kernel_halves_merge_to_full_attention():
    """Capped attention over two halves of the keys, merged by lse, is capped attention over all of
    them; each half's backward given the final out and lse is its share of the naive gradients."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(2, 3, n, 8, generator=gen, dtype=torch.float64) for n in (6, 10, 10, 6))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _reference(*full, False, None, 0.5, None, 0.4)
    ref.backward(dout)
    halves = [(k[:, :, :4], v[:, :, :4]), (k[:, :, 4:], v[:, :, 4:])]
    out, lse = B.attention_with_lse(q, *halves[0], False, 0.4, softcap=0.5)
    B.merge_into(out, lse, *B.attention_with_lse(q, *halves[1], False, 0.4, softcap=0.5))
    assert (out - ref).abs().max() < TOL
    grads = [B.attention_with_lse_backward(dout, q, hk, hv, out, lse, False, 0.4, softcap=0.5) for hk, hv in halves]
    assert (grads[0][0] + grads[1][0] - full[0].grad).abs().max() < TOL
    assert (torch.cat([grads[0][1], grads[1][1]], 2) - full[1].grad).abs().max() < TOL
    assert (torch.cat([grads[0][2], grads[1][2]], 2) - full[2].grad).abs().max() < TOL


def test_merging_two_empty_rows_stays_empty():
    out, lse = torch.zeros(1, 1, 2, 3, dtype=torch.float64), torch.full((1, 1, 2), float("-inf"), dtype=torch.float64)
    block_out = torch.tensor([[[[0.0, 0, 0], [1, 2, 3]]]], dtype=torch.float64)
    B.merge_into(out, lse, block_out, torch.tensor([[[float("-inf"), 0.5]]], dtype=torch.float64))
    assert out.tolist() == [[[[0, 0, 0], [1, 2, 3]]]] and lse.tolist() == [[[float("-inf"), 0.5]]]


def test_bad_window_is_refused():
    q = torch.zeros(1, 2, 4, 4)
    with pytest.raises(ValueError, match="window 0"):
        context_parallel_attention(q, q, q, None, "p2p", True, window=0)


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_step_weights_count_the_pairs_each_step_attends(cp):
    """The plan's per-step weights against a brute-force count of the (query, key) positions each
    rank attends at each ring step, causal and within the window."""
    from megatron_hydra.parallel.context_parallel import balanced_positions
    from megatron_hydra.planning.context_parallel import ring_step_weights

    seq = 48
    assert ring_step_weights(cp, seq, None) is None and ring_step_weights(cp, seq, seq) is None
    for window in (1, 5, 13, 30):
        counts = [[sum(0 <= int(i) - int(j) < window for i in balanced_positions(seq, cp, rank)
                       for j in balanced_positions(seq, cp, (rank - step) % cp))
                   for step in range(cp)] for rank in range(cp)]
        mean = sum(map(sum, counts)) / cp ** 2
        weights = ring_step_weights(cp, seq, window)
        assert max(abs(w - n / mean) for row, crow in zip(weights, counts) for w, n in zip(row, crow)) < 1e-12


def test_ring_seconds_expose_the_transfers_the_window_leaves_uncovered():
    from megatron_hydra.planning.context_parallel import ring_seconds, ring_step_weights

    uniform = ring_seconds(4, 1.0, 1.5, replays=0)
    assert ring_seconds(4, 1.0, 1.5, 0, [[1.0] * 4] * 4) == uniform == (3 + 6 + 1, 1.0)
    # A window of one position: each rank computes at step 0 only, so the later transfers of the
    # forward (2 of 3) and backward (2 of 3, at twice the bytes) have nothing to hide behind.
    weights = ring_step_weights(4, 64, 1)
    assert all(row[1:] == [0.0, 0.0, 0.0] for row in weights)
    raw, exposed = ring_seconds(4, 1.0, 1.5, 0, weights)
    assert raw == uniform[0] and exposed == 2 * 1.0 + 2 * 2.0 + 1.0


def test_capped_and_banded_blocks_take_the_plain_kernels_on_a_gpu(monkeypatch):
    """On fake ``cuda`` tensors a capped or masked block runs the plain-torch kernels (the fused
    ones take neither) in the accumulation dtype, while a plain block still takes the fused one.
    No autograd: a CPU build aborts on its edges."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def fused(*args, **kwargs):
        raise AssertionError("fused kernel")

    monkeypatch.setattr(B, "_efficient_forward", fused)
    monkeypatch.setattr(B, "_efficient_backward", fused)
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(2, 4, 16, 64, device="cuda", dtype=torch.bfloat16)
        mask = torch.zeros(1, 1, 16, 16, device="cuda", dtype=torch.bfloat16)
        for kwargs in ({"softcap": 30.0}, {"mask": mask}, {"mask": mask, "softcap": 30.0}):
            out, lse = B.attention_with_lse(q, q, q, False, 0.125, **kwargs)
            assert (out.shape, out.dtype, lse.dtype) == (q.shape, torch.bfloat16, torch.float32)
            dq, dk, dv = B.attention_with_lse_backward(out, q, q, q, out, lse, False, 0.125, **kwargs)
            assert dq.shape == q.shape and dq.device.type == "cuda"
        with pytest.raises(AssertionError, match="fused kernel"):
            B.attention_with_lse(q, q, q, False, 0.125)
