"""LoRA adapters on the tensor-parallel layers equal their unsharded formula, at tp2 with and
without sequence parallelism, and start as ``peft`` starts them, whatever the layout.

The reference is written here in plain float64 torch on the whole tensors: y = x W^T + b +
scale * (x A^T) B^T, and for the fused QKV layer one (A, B) per projection, their outputs laid out
per query group as [q heads, k, v] (the layer's documented layout). Each rank compares its shard of
the output, of the input gradient and of every adapter gradient (after the optimizer's TP sum of
the tagged ones, ``data_parallel.allreduce_sequence_parallel_grads``) with the same slice of the
reference, to 1e-10; with the adapters off, the output is the base layer's, bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import StubGroup, spawn_ranks, stub_groups

TOL = 1e-10
B, S, IN, RANK, SCALE = 2, 8, 12, 3, 0.75
GROUPS, HEADS_PER_GROUP, D = 2, 2, 4  # the fused QKV case: 2 query groups of 2 heads, head dim 4
PLAIN_OUT = 16
CASES = [f"{layer}{'-sp' if sp else ''}" for layer in ("column", "qkv", "row") for sp in (False, True)]


def _segments(layer):
    """(name, rows per output group) of the adapter's projections, and the number of groups."""
    if layer == "qkv":
        return (("q", HEADS_PER_GROUP * D), ("k", D), ("v", D)), GROUPS
    return (("", 1),), PLAIN_OUT


def _reference(layer, weight, bias, x, pairs):
    """The unsharded layer with its adapters, plain torch: column layers' segments interleaved per
    output group (the fused QKV layout), a row layer's one pair added before its bias."""
    base = torch.nn.functional.linear(x, weight)
    if layer == "row":
        a, b = pairs[0]
        return base + SCALE * (x @ a.t()) @ b.t() + bias
    segments, groups = _segments(layer)
    deltas = [(SCALE * (x @ a.t()) @ b.t()).view(*x.shape[:-1], groups, rows)
              for (a, b), (_, rows) in zip(pairs, segments)]
    return base + bias + torch.cat(deltas, dim=-1).flatten(-2)


def _rel_err(ours, ref) -> float:
    return float((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _build(layer, sp, group, dtype=torch.float64):
    from megatron_hydra.parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron_hydra.parallel.lora import ColumnLoRA, RowLoRA

    if layer == "row":
        mod = RowParallelLinear(PLAIN_OUT, IN, group, sequence_parallel=sp, dtype=dtype)
        mod.lora = RowLoRA(PLAIN_OUT, IN, RANK, SCALE, 0.0, group, dtype)
        return mod
    segments, groups = _segments(layer)
    out = groups * sum(rows for _, rows in segments)
    mod = ColumnParallelLinear(IN, out, group, sequence_parallel=sp, dtype=dtype)
    mod.lora = ColumnLoRA(IN, segments, groups, RANK, SCALE, 0.0, group, dtype)
    return mod


def _check(layer, sp, ps):
    """Errors of this rank's shards against the reference, and whether adapters off is the base."""
    import torch.distributed as dist

    from megatron_hydra.models.lora import adapters_off
    from megatron_hydra.parallel.data_parallel import allreduce_sequence_parallel_grads

    tp, r, group = ps.tp_size, ps.tp_rank, ps.tp_group
    gen = torch.Generator().manual_seed(11)
    dt = torch.float64
    mod = _build(layer, sp, group)
    row = layer == "row"
    in_f, out_f = (PLAIN_OUT, IN) if row else (IN, mod.out_features)
    weight = torch.randn(out_f, in_f, generator=gen, dtype=dt)
    bias = torch.randn(out_f, generator=gen, dtype=dt)
    segments, groups = ((("", 1),), 1) if row else _segments(layer)
    pairs = [(torch.randn(RANK, in_f, generator=gen, dtype=dt),
              torch.randn(out_f if row else groups * rows, RANK, generator=gen, dtype=dt)) for _, rows in segments]
    x_full = torch.randn(B, S, in_f, generator=gen, dtype=dt)
    leaves = [t.clone().requires_grad_() for t in (x_full, *[t for pair in pairs for t in pair])]
    ref = _reference(layer, weight, bias, leaves[0], list(zip(leaves[1::2], leaves[2::2])))
    upstream = torch.randn(ref.shape, generator=gen, dtype=dt)
    ref.backward(upstream)

    def seq(t):  # this rank's sequence slice under SP
        return t.chunk(tp, dim=1)[r] if sp else t

    def part(t, dim):  # this rank's slice along dim (None: whole)
        return t if dim is None else t.chunk(tp, dim=dim)[r]

    # Shard dims: column layers split W, b and each B along the output (whole output groups),
    # A whole; a row layer splits W and A along the input, b and B whole.
    a_dim, b_dim = (1, None) if row else (None, 0)
    ours = [(getattr(mod.lora, f"a{suffix}"), getattr(mod.lora, f"b{suffix}"))  # the contract's names: a_q, b_q, ...
            for suffix in (f"_{name}" if name else "" for name, _ in segments)]
    with torch.no_grad():
        mod.weight.copy_(part(weight, 1 if row else 0))
        mod.bias.copy_(bias if row else part(bias, 0))
        for (a, b), (ours_a, ours_b) in zip(pairs, ours):
            ours_a.copy_(part(a, a_dim))
            ours_b.copy_(part(b, b_dim))
    x = (part(x_full, -1) if row else seq(x_full)).clone().requires_grad_()
    out = mod(x)
    out.backward(seq(upstream) if row else part(upstream, -1))
    adapter = list(mod.lora.parameters())
    allreduce_sequence_parallel_grads(adapter, group)  # the optimizer step's TP sum of tagged grads
    errs = {"out": _rel_err(out, seq(ref.detach()) if row else part(ref.detach(), -1)),
            "grad_input": _rel_err(x.grad, part(leaves[0].grad, -1) if row else seq(leaves[0].grad))}
    for i, ((ours_a, ours_b), a, b) in enumerate(zip(ours, leaves[1::2], leaves[2::2])):
        errs[f"grad_a{i}"] = _rel_err(ours_a.grad, part(a.grad, a_dim))
        errs[f"grad_b{i}"] = _rel_err(ours_b.grad, part(b.grad, b_dim))
    # Adapters off: the base layer, bit for bit (the same layer without its adapter).
    with torch.no_grad():
        with adapters_off(mod):
            off = mod(x)
        lora, mod.lora = mod.lora, None
        base = mod(x)
        mod.lora = lora
    tags = [(getattr(p, "tp_partition_dim", "untagged"), getattr(p, "sequence_parallel", None),
             getattr(p, "lora", False)) for p in adapter]
    dist.barrier(group)
    return {"errors": errs, "off_is_base": torch.equal(off, base), "off_differs": not torch.equal(off, out.detach()),
            "tags": tags}


def _all_checks(rank, world):
    from megatron_hydra.parallel.state import ParallelState

    torch.set_num_threads(1)
    ps = ParallelState.build(tp=world)
    return {case: _check(case.split("-")[0], case.endswith("-sp"), ps) for case in CASES}


@pytest.fixture(scope="module")
def checks():
    results = spawn_ranks(_all_checks, 2)
    assert sorted(results) == [0, 1]
    return results


@pytest.mark.parametrize("case", CASES)
def test_sharded_adapter_equals_formula(checks, case):
    for rank in (0, 1):
        errs = checks[rank][case]["errors"]
        assert len(errs) == 2 + 2 * (3 if case.startswith("qkv") else 1)
        assert all(e < TOL for e in errs.values()), (rank, errs)


@pytest.mark.parametrize("case", CASES)
def test_adapters_off_is_the_base_layer(checks, case):
    for rank in (0, 1):
        assert checks[rank][case]["off_is_base"] and checks[rank][case]["off_differs"]


@pytest.mark.parametrize("case", CASES)
def test_adapter_params_are_tagged(checks, case):
    """Column: A replicated and summed over TP, B split on dim 0; row: A split on dim 1, B
    replicated and summed over TP; every one marked as an adapter."""
    row = case.startswith("row")
    pair = [(1, False, True), (None, True, True)] if row else [(None, True, True), (0, False, True)]
    assert checks[0][case]["tags"] == pair * (3 if case.startswith("qkv") else 1)


# Initialisation, in one process ---------------------------------------------------------------------

def _lora_model(tp, rank):
    """A float64 GPT with adapters on every target, as TP rank ``rank`` of ``tp`` builds it (on the
    meta device) and fills it (``models.init``)."""
    from megatron_hydra.config.transformer_config import LoRASpec, TransformerConfig
    from megatron_hydra.models.gpt import GPTModel
    from megatron_hydra.models.init import materialize
    from megatron_hydra.parallel.state import ParallelState

    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
                            ffn_hidden_size=64, seq_length=8, max_position_embeddings=8, vocab_size=100,
                            padded_vocab_size=128 * tp, position_embedding="rope", normalization="rmsnorm",
                            activation="swiglu", add_bias_linear=False, tie_embeddings=False,
                            params_dtype=torch.float64, lora=LoRASpec(rank=4, alpha=8.0))
    ps = ParallelState(sizes={"pp": 1, "dp": 1, "cp": 1, "tp": tp}, rank=rank,
                       groups={"tp": StubGroup(tp, rank)} if tp > 1 else None)
    with stub_groups():
        model = GPTModel(cfg, ps, device="meta")
    return materialize(model, cfg, 1234, rank, tp, "cpu")


def test_init_is_layout_free_and_as_peft_draws_it():
    """tp2 shards are slices of the tp1 tensors; A uniform in +-1/sqrt(fan_in) (torch's
    kaiming_uniform_ with a=sqrt(5), as peft initialises lora_A: gain sqrt(2/6) times sqrt(3/fan_in)),
    spread over that range; B zero. Different adapters draw different values."""
    whole = {n: p.detach() for n, p in _lora_model(1, 0).named_parameters() if ".lora." in n}
    shards = [dict(_lora_model(2, r).named_parameters()) for r in (0, 1)]
    assert len(whole) == 2 * 2 * (3 + 4)  # per layer an (A, B) of q, k, v, proj, fc1, gate, fc2
    for name, t in whole.items():
        dim = getattr(shards[0][name], "tp_partition_dim")
        parts = [s[name].detach() for s in shards]
        assert torch.equal(torch.cat(parts, dim) if dim is not None else parts[0], t), name
        if dim is None:
            assert torch.equal(parts[1], t), name
        if name.rpartition(".")[2].startswith("b"):
            assert not t.any(), name
            continue
        bound = math.sqrt(2.0 / (1 + 5.0)) * math.sqrt(3.0 / t.shape[1])
        assert float(t.abs().max()) <= bound and float(t.abs().max()) > 0.9 * bound, name
        assert abs(float(t.mean())) < 4 * bound / math.sqrt(3 * t.numel()), name  # within 4 standard errors
    assert not torch.equal(whole["layers.0.attention.qkv.lora.a_q"], whole["layers.0.attention.qkv.lora.a_k"])
    assert not torch.equal(whole["layers.0.mlp.fc1.lora.a"], whole["layers.1.mlp.fc1.lora.a"])


def test_qkv_dropout_draws_one_mask_per_projection():
    """peft's q_proj, k_proj and v_proj adapters each drop their input with their own mask: with
    equal adapters the three outputs differ in training and agree in evaluation."""
    from megatron_hydra.parallel.lora import ColumnLoRA

    torch.manual_seed(0)
    lora = ColumnLoRA(16, (("q", 2), ("k", 2), ("v", 2)), 1, rank=3, scale=1.0, p_dropout=0.5, tp_group=None,
                      dtype=torch.float64)
    a, b = torch.randn(3, 16, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)
    with torch.no_grad():
        for name in "qkv":
            getattr(lora, f"a_{name}").copy_(a)
            getattr(lora, f"b_{name}").copy_(b)
    x = torch.randn(5, 16, dtype=torch.float64)
    out = lora(x).view(5, 3, 2)
    assert (out[:, 0] - out[:, 1]).abs().max() > 1e-3 and (out[:, 1] - out[:, 2]).abs().max() > 1e-3
    lora.eval()
    out = lora(x).view(5, 3, 2)
    torch.testing.assert_close(out[:, 0], out[:, 1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[:, 1], out[:, 2], rtol=1e-12, atol=1e-12)
