"""Context-parallel attention (ring p2p and Ulysses a2a) against full attention in one process.

The reference is ``F.scaled_dot_product_attention`` over the whole sequence, with autograd for the
gradients; each rank compares its shard of it (``shard_sequence``) with what
``context_parallel_attention`` gives from the sharded inputs, in float64, to 1e-10. One spawn per
world size runs every case; the communicated bytes are checked against the analytic volume.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_hydra.parallel import block_attention as B
from megatron_hydra.parallel.context_parallel import (balanced_positions, context_parallel_attention,
                                                      record_ring_timeline, shard_sequence)
from conftest import spawn_ranks

BATCH, HEAD_DIM, CHUNK = 2, 8, 3  # sequence = 2 * cp * CHUNK
TOL = 1e-10


def _cases(world: int):
    """(comm_type, causal, heads, groups, scale): GQA and MHA, causal or not, both comm types.
    At cp4, a2a's GQA case has groups % cp != 0, so its kv heads are repeated before splitting."""
    for comm in ("p2p", "a2a"):
        shapes = [(8, 2), (4, 4)] if comm == "a2a" and world == 4 else [(4, 2), (4, 4)]
        for causal in (True, False):
            for heads, groups in shapes:
                yield comm, causal, heads, groups, (0.3 if groups < heads else None)


def _inputs(heads: int, groups: int, seq: int):
    gen = torch.Generator().manual_seed(1234 + heads * 10 + groups)
    q, k, v, dout = (torch.randn(BATCH, n, seq, HEAD_DIM, generator=gen, dtype=torch.float64)
                     for n in (heads, groups, groups, heads))
    return q, k, v, dout


def _check(case, group, rank: int, cp: int):
    """(max abs error of out, dq, dk, dv; bytes counted in forward; in backward) on this rank."""
    from megatron_hydra.parallel.collectives import count_comm

    comm, causal, heads, groups, scale = case
    q, k, v, dout = _inputs(heads, groups, 2 * cp * CHUNK)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=causal, scale=scale, enable_gqa=groups < heads)
    ref.backward(dout)
    local = [shard_sequence(t, 2, cp, rank).requires_grad_() for t in (q, k, v)]
    with count_comm() as forward:
        out = context_parallel_attention(*local, group, comm, causal, scale)
    with count_comm() as backward:
        out.backward(shard_sequence(dout, 2, cp, rank))
    expected = [ref.detach()] + [t.grad for t in full]
    errors = [float((got - shard_sequence(want, 2, cp, rank)).abs().max())
              for got, want in zip([out.detach()] + [t.grad for t in local], expected)]
    return errors, dict(forward.bytes), dict(backward.bytes)


def _worker(rank: int, world: int):
    import torch.distributed as dist

    group = dist.new_group(list(range(world)))
    results = {case: _check(case, group, rank, world) for case in _cases(world)}
    with record_ring_timeline() as timeline:
        _check(("p2p", True, 4, 2, None), group, rank, world)
    results["timeline"] = [(e.direction, e.step, e.phase) for e in timeline]
    if world == 4:  # cp2 groups whose ranks are not the global ones: {0, 2} and {1, 3}
        pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        for comm in ("p2p", "a2a"):
            results[("pair", comm)] = _check((comm, True, 4, 2, None), pairs[rank % 2], rank // 2, 2)
    return results


def _analytic(comm: str, cp: int, heads: int, groups: int):
    """Bytes a rank hands to the cp collectives: (forward, backward)."""
    activation = BATCH * CHUNK * 2 * HEAD_DIM * 8  # one head of a local [b, ., s/cp, d] float64
    kv = 2 * groups * activation
    if comm == "p2p":  # K/V to the next rank cp-1 times; in backward also dK/dV cp times
        return {"cp_p2p": (cp - 1) * kv}, {"cp_p2p": (2 * cp - 1) * kv}
    kv_heads = groups if groups % cp == 0 else (groups * cp // math.gcd(groups, cp))
    four = (2 * heads + 2 * kv_heads) * activation  # q, k, v and out; dout, dq, dk, dv
    return {"cp_a2a": four}, {"cp_a2a": four}


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_attention_matches_full_attention(world):
    results = spawn_ranks(_worker, world)
    assert sorted(results) == list(range(world))
    for rank, per_case in results.items():
        for case in _cases(world):
            errors, forward, backward = per_case[case]
            assert max(errors) < TOL, (rank, case, errors)
            comm, _, heads, groups, _ = case
            assert (forward, backward) == _analytic(comm, world, heads, groups), (rank, case)
        steps = [("forward", s, p) for s in range(world) for p in ("compute", "wait")]
        steps += [("backward", s, p) for s in range(world) for p in ("compute", "wait")] + [("backward", world, "wait")]
        assert per_case["timeline"] == steps
        if world == 4:
            for comm in ("p2p", "a2a"):
                assert max(per_case[("pair", comm)][0]) < TOL, (rank, comm)


def test_balanced_positions_and_shards():
    assert balanced_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert balanced_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert balanced_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    assert balanced_positions(6, 1, 0).tolist() == [0, 1, 2, 3, 4, 5]
    t = torch.arange(16).view(2, 8)
    assert shard_sequence(t, 1, 2, 0).tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]]
    assert shard_sequence(t, 1, 2, 1).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert shard_sequence(t, 1, 1, 0) is t
    with pytest.raises(ValueError, match="divisible"):
        shard_sequence(torch.zeros(6), 0, 2, 0)


@pytest.mark.parametrize("kernels", ["device", "math"])
def test_block_kernel_halves_merge_to_full_attention(kernels):
    """Attention over two halves of the keys, merged by lse, is attention over all of them; each
    half's backward given the final out and lse is its share of the full gradients."""
    forward, backward = ((B.attention_with_lse, B.attention_with_lse_backward) if kernels == "device"
                         else (B._math_forward, B._math_backward))
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 3, n, 8, generator=gen, dtype=torch.float64) for n in (6, 10, 10, 6))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, scale=0.4)
    ref.backward(dout)
    halves = [(k[:, :, :4], v[:, :, :4]), (k[:, :, 4:], v[:, :, 4:])]
    out, lse = forward(q, *halves[0], False, 0.4)
    B.merge_into(out, lse, *forward(q, *halves[1], False, 0.4))
    assert (out - ref).abs().max() < TOL
    assert (lse - torch.logsumexp(q @ k.transpose(-2, -1) * 0.4, -1)).abs().max() < TOL
    grads = [backward(dout, q, hk, hv, out, lse, False, 0.4) for hk, hv in halves]
    assert (grads[0][0] + grads[1][0] - full[0].grad).abs().max() < TOL
    assert (torch.cat([grads[0][1], grads[1][1]], 2) - full[1].grad).abs().max() < TOL
    assert (torch.cat([grads[0][2], grads[1][2]], 2) - full[2].grad).abs().max() < TOL
    square = (q, k[:, :, :6], v[:, :, :6])
    causal_out, _ = forward(*square, True, 0.4)
    assert (causal_out - F.scaled_dot_product_attention(*square, is_causal=True, scale=0.4)).abs().max() < TOL


def test_gpu_block_kernels_run_on_fake_cuda_tensors():
    """The CUDA path (memory-efficient kernel; float64 falls back to math) on fake tensors: shapes,
    dtypes and the sliced/padded lse. No autograd here: a CPU build aborts on autograd edges of
    fake ``cuda`` tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        for dtype in (torch.bfloat16, torch.float64):
            q = torch.empty(2, 4, 40, 64, device="cuda", dtype=dtype)
            out, lse = B.attention_with_lse(q, q, q, True, 0.125)
            assert (out.shape, out.dtype) == (q.shape, dtype)
            assert (lse.shape, lse.dtype) == ((2, 4, 40), B.accumulation_dtype(dtype))
            dq, dk, dv = B.attention_with_lse_backward(out, q, q, q, out, lse, True, 0.125)
            assert dq.shape == dk.shape == dv.shape == q.shape and dq.device.type == "cuda"


def test_one_rank_is_plain_attention():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, n, 8, 8, generator=gen, dtype=torch.float64) for n in (4, 2, 2))
    out = context_parallel_attention(q, k, v, None, "p2p", True)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
