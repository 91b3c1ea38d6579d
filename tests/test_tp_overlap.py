"""parallel.tp_comm_overlap: the collective matmuls equal the plain sequence-parallel layers.

One spawn of 4 gloo ranks checks every case (tp=2 as two independent TP groups, and tp=4):
- each layer alone (column with bias, the gated pair through ``same_input``, row with bias, a
  column layer with a LoRA adapter, which keeps the plain path):
  output, input gradient and every parameter gradient of the overlapped layer against the plain
  layer holding the same shard (float64, 1e-9), and the collectives each issued: ring transfers
  only with the switch on, the all-gather / reduce-scatter without it;
- a small GPT with sequence parallelism and the switch on, trained 2 AdamW steps beside the
  single-process model (TP=1) in the same rank: the losses of both steps and the final weights,
  gathered, equal (1e-9); one variant with full recomputation and SwiGLU.
Then the derive errors, and one dry-run step on the fake process group with the switch on.
"""

from __future__ import annotations

import pytest

from conftest import SMALL, compose_config, spawn_ranks
from megatron_hydra.config import derive
from megatron_hydra.errors import ConfigError
from megatron_hydra.parallel import collectives as C
# At module level, as in test_dry_run*.py: the stand-in device registers before this process's
# first backward (registered after it, autograd's device queues miss it).
from megatron_hydra.training import dry_run as D
from megatron_hydra.training import fake_gpu

TOL = 1e-9
B, S, IN, OUT = 2, 8, 12, 16
LAYER_CASES = [f"{layer}-tp{tp}" for layer in ("column", "gated", "row") for tp in (2, 4)] + ["lora-tp2"]
GPT = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=4, kv_channels=8,
           ffn_hidden_size=64, seq_length=8, max_position_embeddings=8, vocab_size=128)
MODEL_CASES = {
    "gelu-tp2": dict(activation="gelu", add_bias_linear=True, position_embedding="learned"),
    "swiglu-recompute-tp2": dict(activation="swiglu", add_bias_linear=False, position_embedding="rope",
                                 normalization="rmsnorm", recompute_granularity="full"),
    "gelu-tp4": dict(activation="gelu", add_bias_linear=True, position_embedding="learned"),
}


def _rel(ours, ref) -> float:
    return float((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _gather(t, dim, group):
    import torch
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _run_layer(layer: str, ps, overlap: bool):
    """Output and gradients of one layer (same seed, same shard) with the switch ``overlap``, and
    the kinds of the collectives it issued."""
    import torch

    from megatron_hydra.parallel import collectives as C
    from megatron_hydra.parallel.layers import ColumnParallelLinear, RowParallelLinear, same_input
    from megatron_hydra.parallel.lora import ColumnLoRA

    tp, r, group = ps.tp_size, ps.tp_rank, ps.tp_group
    gen = torch.Generator().manual_seed(11)
    dt = torch.float64
    kw = dict(sequence_parallel=True, tp_comm_overlap=overlap, dtype=dt)
    if layer == "row":
        mods = [RowParallelLinear(IN, OUT, group, **kw)]
        x = torch.randn(B, S, IN, generator=gen, dtype=dt).chunk(tp, dim=-1)[r]
    else:
        mods = [ColumnParallelLinear(IN, OUT, group, **kw) for _ in range(2 if layer == "gated" else 1)]
        x = torch.randn(B, S, IN, generator=gen, dtype=dt).chunk(tp, dim=1)[r]
    if layer == "lora":
        mods[0].lora = ColumnLoRA(IN, [("", 1)], OUT, rank=2, scale=0.5, p_dropout=0.0, tp_group=group, dtype=dt)
    for mod in mods:
        with torch.no_grad():
            for p in mod.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=dt))
    x = x.clone().requires_grad_(True)
    called = []  # forward pre-hooks (the distributed optimizer waits for a layer's gather in one) must run
    for mod in mods:
        mod.register_forward_pre_hook(lambda m, args: called.append(m))
    with C.record_comm() as rec:
        outs = same_input(x, *mods) if layer == "gated" else (mods[0](x),)
        upstream = [torch.randn(o.shape, generator=gen, dtype=dt) for o in outs]
        torch.autograd.backward(outs, upstream)
    assert all(any(m is mod for m in called) for mod in mods), layer
    grads = [x.grad] + [p.grad for mod in mods for p in mod.parameters()]
    return [o.detach() for o in outs], grads, sorted({e.kind for e in rec.events}), len(rec.events)


def _check_layer(layer: str, ps):
    outs, grads, kinds, calls = _run_layer(layer, ps, True)
    ref_outs, ref_grads, ref_kinds, _ = _run_layer(layer, ps, False)
    return {"out": max(_rel(o, r) for o, r in zip(outs, ref_outs)),
            "grads": max(_rel(g, r) for g, r in zip(grads, ref_grads)),
            "kinds": kinds, "ref_kinds": ref_kinds, "calls": calls}


def _logical(model, ps):
    """Every parameter gathered to its logical (TP=1) shape, by name."""
    out = {}
    for name, p in model.named_parameters():
        dim = getattr(p, "tp_partition_dim", None)
        out[name] = p.detach() if dim is None else _gather(p.detach(), dim, ps.tp_group)
    return out


def _train(model, ps, tokens, labels, steps=2):
    import torch

    from megatron_hydra.parallel.data_parallel import allreduce_sequence_parallel_grads

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(tokens, labels).mean()
        loss.backward()
        if ps is not None:
            allreduce_sequence_parallel_grads(model.parameters(), ps.tp_group)
        opt.step()
        losses.append(loss.detach())
    return losses


def _check_model(case: str, ps):
    import torch

    from megatron_hydra.config.transformer_config import TransformerConfig
    from megatron_hydra.models.gpt import GPTModel
    from megatron_hydra.models.init import init_weights
    from megatron_hydra.parallel.state import ParallelState

    tp = ps.tp_size
    shape = {**GPT, **MODEL_CASES[case]}
    cfg = TransformerConfig(**shape, padded_vocab_size=128, sequence_parallel=True, tp_comm_overlap=True,
                            params_dtype=torch.float64)
    ref_cfg = TransformerConfig(**shape, padded_vocab_size=128, params_dtype=torch.float64)
    model, ref = GPTModel(cfg, ps), GPTModel(ref_cfg, ParallelState.single())
    init_weights(model, cfg, 1234, ps.tp_rank, tp)
    init_weights(ref, ref_cfg, 1234, 0, 1)
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 128, (2, cfg.seq_length), generator=gen)
    labels = torch.randint(0, 128, (2, cfg.seq_length), generator=gen)
    losses, ref_losses = _train(model, ps, tokens, labels), _train(ref, None, tokens, labels)
    ours, theirs = _logical(model, ps), dict(ref.named_parameters())
    return {"losses": max(_rel(a, b) for a, b in zip(losses, ref_losses)),
            "weights": max(_rel(ours[n], theirs[n].detach()) for n in theirs),
            "names": sorted(ours) == sorted(theirs)}


def _all_checks(rank, world):
    import torch

    from megatron_hydra.parallel.state import ParallelState

    torch.set_num_threads(1)
    results = {}
    for tp in (2, 4):
        ps = ParallelState.build(tp=tp, dp=world // tp)
        for case in LAYER_CASES:
            if case.endswith(f"-tp{tp}"):
                results[case] = _check_layer(case.split("-")[0], ps)
        for case in MODEL_CASES:
            if case.endswith(f"-tp{tp}"):
                results[case] = _check_model(case, ps)
    return results


@pytest.fixture(scope="module")
def checks():
    results = spawn_ranks(_all_checks, 4)
    assert sorted(results) == [0, 1, 2, 3]
    return results


@pytest.mark.parametrize("case", LAYER_CASES)
def test_layer_equals_plain_sequence_parallel_layer(checks, case):
    for rank in range(4):
        got = checks[rank][case]
        assert got["out"] < TOL and got["grads"] < TOL, (rank, got)


@pytest.mark.parametrize("case", [c for c in LAYER_CASES if not c.startswith("lora")])
def test_switch_on_issues_ring_transfers_instead_of_collectives(checks, case):
    tp = int(case.rsplit("tp", 1)[1])
    for rank in range(4):
        got = checks[rank][case]
        assert got["kinds"] == ["tp_p2p"], got
        assert got["calls"] == 2 * (tp - 1)  # tp - 1 ring steps forward, as many backward
        assert got["ref_kinds"] == ["all_gather", "reduce_scatter"]


def test_layer_with_lora_adapter_keeps_the_plain_path(checks):
    for rank in range(4):
        assert checks[rank]["lora-tp2"]["kinds"] == ["all_gather", "reduce_scatter"]


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_gpt_trains_as_the_single_process(checks, case):
    for rank in range(4):
        got = checks[rank][case]
        assert got["names"] and got["losses"] < TOL and got["weights"] < TOL, (rank, got)


SP = ["parallel=tp2", "trainer.devices=2", "parallel.sequence_parallel=true"]


@pytest.mark.parametrize("overrides,keys", [
    (["parallel=tp2", "trainer.devices=2", "parallel.tp_comm_overlap=true"],
     ("parallel.tp_comm_overlap", "parallel.sequence_parallel=true")),
    ([*SP, "parallel.tp_comm_overlap=true", "model.transformer_impl=transformer_engine", "trainer=gpu"],
     ("parallel.tp_comm_overlap", "model.transformer_impl")),
])
def test_config_errors_name_the_keys(overrides, keys):
    with pytest.raises(ConfigError) as err:
        derive(compose_config(overrides))
    message = str(err.value)
    assert "\n" not in message and all(k in message for k in keys), message


def test_derive_passes_the_switch_to_the_model():
    assert derive(compose_config([*SP, "parallel.tp_comm_overlap=true"])).transformer.tp_comm_overlap
    assert not derive(compose_config(SP)).transformer.tp_comm_overlap


def test_dry_run_steps_with_the_switch_on():
    """The ring's batched isend/irecv runs on the fake process group and the fake GPU."""
    cfg = compose_config([*SMALL, "trainer=gpu", *SP, "parallel.tp_comm_overlap=true", "data.global_batch_size=2"])
    with C.record_comm() as rec:
        (result,) = D.dry_run(cfg, derive(cfg), [1])
    assert result.save_items > 0
    if fake_gpu.registered():  # else the dry run ran in a process of its own, whose collectives are not seen here
        assert "tp_p2p" in {e.kind for e in rec.events}
