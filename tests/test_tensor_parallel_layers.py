"""Each tensor-parallel layer alone equals the unsharded computation written in plain torch.

One spawn of 4 gloo ranks checks every case: the ranks build ParallelState for tp=1, 2 and 4
(tp=2 runs as two independent TP groups), every rank draws the same full weights, inputs and
upstream gradients from a fixed seed, keeps its shard, and compares its shard of the output and
of every gradient with the same slice of the reference (``F.linear``, ``F.embedding``,
``F.cross_entropy`` on the full tensors). Gradients of parameters that sequence parallelism
leaves partial on each rank are summed over TP with a raw ``dist.all_reduce`` first, as the
optimizer step does. Float64 throughout: a real error, or arithmetic dropped to fp32 (1e-7),
is far above the 1e-10 held to.
"""

from __future__ import annotations

import itertools

import pytest

from conftest import spawn_ranks

WORLD = 4
TOL = 1e-10
B, S, IN, OUT, VOCAB = 2, 8, 12, 16, 24
LAYER_CASES = [f"{layer}-tp{tp}{'-sp' if sp else ''}"
               for layer in ("column", "column_gather", "row", "embedding") for tp in (2, 4) for sp in (False, True)
               if not (layer == "column_gather" and sp)]
CE_CASES = [f"cross_entropy-tp{tp}" for tp in (1, 2, 4)]
# bf16 and fp16 logits, token-major and vocabulary-major (as the heads hand them over, off and on a CPU): the
# loss takes their exponentials in fp32 slices of the vocabulary, here 5 entries each (a ragged last
# slice at every tp), recomputed in backward or, handed over in bf16, stored. The reference is fp64
# on the same 16-bit values: the loss is fp32 arithmetic, the gradient is rounded to 16 bits (2^-8
# relative for bf16), and each of its bf16 entries, the targets' p - 1 included (half of the targets
# are the largest logit; logits of two scales, so that targets' p spans 0 to 1), is within two bf16
# roundings of the reference plus fp32's absolute resolution of p - 1 (``_entry_err``).
CE16_CASES = [f"cross_entropy_bf16-tp{tp}" for tp in (1, 2, 4)]
CE16_TOL = {"out": 1e-6, "grad_logits": 2.0 ** -8, "grad_entry_bf16": 2.01}


def _rel_err(ours, ref) -> float:
    return float((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _entry_err(ours, ref, upstream) -> float:
    """The largest error of one entry of a bf16 gradient, in units of one bf16 rounding of it
    (2^-8 relative) plus fp32's absolute resolution of its token's p - 1 (2^-23 times the token's
    upstream gradient), which any fp32 loss has (and which also covers exponentials fp32 flushes)."""
    unit = ref.abs() * 2.0 ** -8 + upstream.abs().unsqueeze(-1) * 2.0 ** -23
    return float(((ours - ref).abs() / unit).max())


def _sum_over(t, group):
    import torch.distributed as dist

    t = t.clone()
    dist.all_reduce(t, group=group)
    return t


def _check_layer(layer: str, sp: bool, ps):
    """Errors of this rank's shard of the output and of every gradient against the reference."""
    import torch
    import torch.nn.functional as F

    from megatron_hydra.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    tp, r, group = ps.tp_size, ps.tp_rank, ps.tp_group
    gen = torch.Generator().manual_seed(7)
    dt = torch.float64

    def seq(t):  # this rank's sequence slice under SP, else the whole tensor
        return t.chunk(tp, dim=1)[r] if sp else t

    def feat(t, dim=-1):
        return t.chunk(tp, dim=dim)[r]

    if layer == "embedding":
        weight = torch.randn(VOCAB, IN, generator=gen, dtype=dt)
        ids = torch.randint(0, VOCAB, (B, S), generator=gen)
        mod = VocabParallelEmbedding(VOCAB, IN, group, sequence_parallel=sp, dtype=dt)
        with torch.no_grad():
            mod.weight.copy_(feat(weight, 0))
        w = weight.clone().requires_grad_()
        ref = F.embedding(ids, w)
        upstream = torch.randn(ref.shape, generator=gen, dtype=dt)
        ref.backward(upstream)
        out = mod(ids)
        out.backward(seq(upstream))
        return {"out": _rel_err(out, seq(ref.detach())), "grad_weight": _rel_err(mod.weight.grad, feat(w.grad, 0))}

    weight = torch.randn(OUT, IN, generator=gen, dtype=dt)
    bias = torch.randn(OUT, generator=gen, dtype=dt)
    x_full = torch.randn(B, S, IN, generator=gen, dtype=dt)
    w, b, x = (t.clone().requires_grad_() for t in (weight, bias, x_full))
    ref = F.linear(x, w, b)
    upstream = torch.randn(ref.shape, generator=gen, dtype=dt)
    ref.backward(upstream)

    if layer.startswith("column"):
        gather = layer == "column_gather"
        mod = ColumnParallelLinear(IN, OUT, group, gather_output=gather, sequence_parallel=sp, dtype=dt)
        with torch.no_grad():
            mod.weight.copy_(feat(weight, 0))
            mod.bias.copy_(feat(bias, 0))
        x_local = seq(x_full).clone().requires_grad_()
        out = mod(x_local)
        out.backward(upstream if gather else feat(upstream))
        return {
            "out": _rel_err(out, ref.detach() if gather else feat(ref.detach())),
            "grad_input": _rel_err(x_local.grad, seq(x.grad)),
            "grad_weight": _rel_err(mod.weight.grad, feat(w.grad, 0)),
            "grad_bias": _rel_err(mod.bias.grad, feat(b.grad)),
        }

    mod = RowParallelLinear(IN, OUT, group, sequence_parallel=sp, dtype=dt)
    with torch.no_grad():
        mod.weight.copy_(feat(weight, 1))
        mod.bias.copy_(bias)
    x_local = feat(x_full).clone().requires_grad_()
    out = mod(x_local)
    out.backward(seq(upstream))
    assert mod.bias.sequence_parallel == sp
    bias_grad = _sum_over(mod.bias.grad, group) if sp else mod.bias.grad
    return {
        "out": _rel_err(out, seq(ref.detach())),
        "grad_input": _rel_err(x_local.grad, feat(x.grad)),
        "grad_weight": _rel_err(mod.weight.grad, feat(w.grad, 1)),
        "grad_bias": _rel_err(bias_grad, b.grad),
    }


def _check_cross_entropy(ps):
    import torch
    import torch.nn.functional as F

    from megatron_hydra.parallel.cross_entropy import vocab_parallel_cross_entropy

    gen = torch.Generator().manual_seed(11)
    # Large logits: a naive exp() would overflow, so this also checks the max-shift.
    logits = (torch.randn(B, S, VOCAB, generator=gen, dtype=torch.float64) * 30).requires_grad_()
    target = torch.randint(0, VOCAB, (B, S), generator=gen)
    upstream = torch.rand(B, S, generator=gen, dtype=torch.float64)
    ref = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none").view(B, S)
    ref.backward(upstream)
    shard = logits.detach().chunk(ps.tp_size, dim=-1)[ps.tp_rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, target, ps.tp_group)
    loss.backward(upstream)
    # Handed over, as the models do: a non-leaf copy of the shard becomes its exponentials, then the gradient.
    handed = shard.detach().clone().requires_grad_()
    loss_handed = vocab_parallel_cross_entropy(handed * 1.0, target, ps.tp_group, inplace=True)
    loss_handed.backward(upstream)
    ref_grad = logits.grad.chunk(ps.tp_size, dim=-1)[ps.tp_rank]
    return {"out": _rel_err(loss, ref.detach()), "grad_logits": _rel_err(shard.grad, ref_grad),
            "out_inplace": _rel_err(loss_handed, ref.detach()), "grad_logits_inplace": _rel_err(handed.grad, ref_grad)}


def _check_cross_entropy_bf16(ps):
    import torch
    import torch.nn.functional as F

    import megatron_hydra.parallel.cross_entropy as CE

    gen = torch.Generator().manual_seed(12)
    errs = {"out": 0.0, "grad_logits": 0.0, "grad_entry_bf16": 0.0}
    for scale, dtype in itertools.product((30, 2), (torch.bfloat16, torch.float16)):
        values = torch.randn(B, S, VOCAB, generator=gen) * scale
        target = torch.randint(0, VOCAB, (B, S), generator=gen)
        target[:, ::2] = values[:, ::2].argmax(dim=-1)
        upstream = torch.rand(B, S, generator=gen, dtype=torch.float64)
        logits = values.to(dtype)
        full = logits.double().requires_grad_()
        ref = F.cross_entropy(full.flatten(0, 1), target.flatten(), reduction="none").view(B, S)
        ref.backward(upstream)
        ref_grad = full.grad.chunk(ps.tp_size, dim=-1)[ps.tp_rank]
        for vocab_major in (False, True):
            for inplace in (False, True):
                local = logits.chunk(ps.tp_size, dim=-1)[ps.tp_rank]
                # The leaf is [vocab / tp, tokens] for the vocabulary-major case; the loss sees its transpose.
                leaf = (local.reshape(B * S, -1).t().contiguous() if vocab_major else local.clone()).requires_grad_()
                # Handed over, as the models do, the logits are a non-leaf tensor (the head's output).
                stored = leaf * 1 if inplace else leaf
                shard = stored.t().view(B, S, -1) if vocab_major else stored
                chunk, CE.CHUNK_ELEMENTS = CE.CHUNK_ELEMENTS, B * S * 5
                try:
                    assert len(CE.vocab_chunks(VOCAB // ps.tp_size, B * S)) > 1
                    loss = CE.vocab_parallel_cross_entropy(shard, target, ps.tp_group, inplace=inplace)
                    loss.backward(upstream.float())
                finally:
                    CE.CHUNK_ELEMENTS = chunk
                grad = leaf.grad.t().reshape(B, S, -1) if vocab_major else leaf.grad
                assert leaf.grad.dtype == dtype
                if inplace:  # handed-over 16-bit logits become their gradient
                    assert torch.equal(stored.detach(), leaf.grad)
                else:  # else they stay as they were
                    assert torch.equal(shard.detach(), local)
                errs["out"] = max(errs["out"], _rel_err(loss.double(), ref.detach()))
                errs["grad_logits"] = max(errs["grad_logits"], _rel_err(grad.double(), ref_grad))
                if dtype == torch.bfloat16:  # fp16's smallest exponentials underflow, in any loss
                    entry = _entry_err(grad.double(), ref_grad, upstream)
                    errs["grad_entry_bf16"] = max(errs["grad_entry_bf16"], entry)
    return errs


def _all_checks(rank, world):
    import torch

    from megatron_hydra.parallel.state import ParallelState

    torch.set_num_threads(1)
    results = {}
    for tp in (1, 2, 4):
        ps = ParallelState.build(tp=tp, dp=world // tp)
        results[f"cross_entropy-tp{tp}"] = _check_cross_entropy(ps)
        results[f"cross_entropy_bf16-tp{tp}"] = _check_cross_entropy_bf16(ps)
        if tp == 1:
            continue
        for case in LAYER_CASES:
            layer, case_tp, *rest = case.split("-")
            if case_tp == f"tp{tp}":
                results[case] = _check_layer(layer, bool(rest), ps)
    return results


@pytest.fixture(scope="module")
def errors():
    results = spawn_ranks(_all_checks, WORLD)
    assert sorted(results) == list(range(WORLD))
    return results


@pytest.mark.parametrize("case", LAYER_CASES + CE_CASES)
def test_sharded_equals_unsharded(errors, case):
    for rank in range(WORLD):
        errs = errors[rank][case]
        assert errs and all(e < TOL for e in errs.values()), (rank, errs)


@pytest.mark.parametrize("case", CE16_CASES)
def test_sharded_bf16_cross_entropy_equals_fp64_reference(errors, case):
    for rank in range(WORLD):
        errs = errors[rank][case]
        assert errs.keys() == CE16_TOL.keys() and all(errs[k] < CE16_TOL[k] for k in errs), (rank, errs)
