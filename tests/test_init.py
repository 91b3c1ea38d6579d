"""Initialisation: counter-based, shard by shard, on models built on the meta device.

- every layout's gathered weights equal the single-process model's exactly (tp 1/2/4, whose
  vocabulary padding differs; a pp2 stage split; GPT and the Llama form: SwiGLU, GQA, RoPE, untied
  head). The TP ranks are built in this one process: the layers ask the collectives module for
  their group's size and rank, which a stub group answers, so no process group is needed;
- the values are normal(0, std) by analytic reference (moments, the one-sigma mass), uncorrelated
  across names, the same for the same name and seed, different for another seed; the rules
  (zero biases, unit norms, scaled residual projections, zero vocabulary padding) hold;
- a TP shard is computed from its own elements only, in bounded chunks (the generator is watched:
  the indices it is asked for add up to the shard, never the logical tensor);
- after materialisation nothing is left on the meta device, and the RoPE tables equal a fresh
  computation.
"""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch

from conftest import SMALL, StubGroup, compose_config, stub_groups
from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.models import init
from megatron_hydra.models.gpt import GPTModel
from megatron_hydra.parallel.state import ParallelState

VOCAB = 300
BASE = dict(num_layers=3, hidden_size=32, num_attention_heads=4, kv_channels=8, seq_length=16,
            max_position_embeddings=16, vocab_size=VOCAB, params_dtype=torch.float64)
VARIANTS = {
    "gpt": dict(BASE, num_query_groups=4, ffn_hidden_size=64),
    "llama": dict(BASE, num_query_groups=2, ffn_hidden_size=48, activation="swiglu", normalization="rmsnorm",
                  position_embedding="rope", add_bias_linear=False, tie_embeddings=False),
}
SEED = 1234




def config(variant: str, tp: int) -> TransformerConfig:
    return TransformerConfig(**VARIANTS[variant], padded_vocab_size=128 * tp * math.ceil(VOCAB / (128 * tp)))


def shard(variant: str, tp: int, tp_rank: int, **stage) -> GPTModel:
    """TP rank ``tp_rank``'s model (or pipeline stage) at tp, built on meta and materialised."""
    cfg = config(variant, tp)
    ps = ParallelState(sizes={"pp": 1, "dp": 1, "cp": 1, "tp": tp}, rank=tp_rank,
                       groups={"tp": StubGroup(tp, tp_rank)} if tp > 1 else None)
    with stub_groups():
        model = GPTModel(cfg, ps, device="meta", **stage)
    return init.materialize(model, cfg, SEED, tp_rank, tp, "cpu")


def gathered(variant: str, tp: int, **stage):
    """{name: logical tensor} from all tp ranks' shards, vocabulary padding cut off (after
    checking it is zero)."""
    ranks = [dict(shard(variant, tp, r, **stage).named_parameters()) for r in range(tp)]
    out = {}
    for name, p in ranks[0].items():
        dim = p.tp_partition_dim
        full = p.detach() if dim is None else torch.cat([r[name].detach() for r in ranks], dim)
        if name in init.VOCAB_TABLES:
            assert not full[VOCAB:].any(), name
            full = full[:VOCAB]
        out[name] = full
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_layout_gathers_the_single_process_weights(variant):
    single = gathered(variant, 1)
    for tp in (2, 4):
        ours = gathered(variant, tp)
        assert sorted(ours) == sorted(single)
        assert all(torch.equal(ours[n], single[n]) for n in single), tp
    # A pp2 split: stage 0 holds the embedding and layer 0, stage 1 layers 1-2 and the head (at tp2).
    first = gathered(variant, 2, layers=[0], post_process=False)
    last = gathered(variant, 2, layers=[1, 2], pre_process=False)
    for part in (first, last):
        assert all(torch.equal(t, single[n]) for n, t in part.items())
    assert set(first) | set(last) >= set(single)


def test_values_are_normal_per_rule_and_seeded():
    cfg = config("llama", 1)
    n = 1 << 18
    a = init.logical_tensor("layers.0.attention.qkv.weight", [512, 512], cfg, SEED, torch.float64)
    z = a.flatten() / cfg.init_std
    # Analytic references for n standard normals: mean 0 (sd 1/sqrt(n)), variance 1 (sd
    # sqrt(2/n)), kurtosis 3, P(|z| < 1) = erf(1/sqrt(2)); all held to 5 standard errors.
    assert abs(z.mean().item()) < 5 / math.sqrt(n)
    assert abs(z.var().item() - 1) < 5 * math.sqrt(2 / n)
    assert abs((z ** 4).mean().item() - 3) < 5 * math.sqrt(96 / n)
    p1 = math.erf(1 / math.sqrt(2))
    assert abs((z.abs() < 1).double().mean().item() - p1) < 5 * math.sqrt(p1 * (1 - p1) / n)
    # Another name, another layer, another seed: uncorrelated, and not a rearrangement either.
    others = [init.logical_tensor("layers.0.mlp.fc1.weight", [512, 512], cfg, SEED, torch.float64),
              init.logical_tensor("layers.1.attention.qkv.weight", [512, 512], cfg, SEED, torch.float64),
              init.logical_tensor("layers.0.attention.qkv.weight", [512, 512], cfg, SEED + 1, torch.float64)]
    for b in others:
        r = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()
        assert abs(r) < 5 / math.sqrt(n)
        assert not torch.equal(a.flatten().sort().values, b.flatten().sort().values)
    assert torch.equal(a, init.logical_tensor("layers.0.attention.qkv.weight", [512, 512], cfg, SEED, torch.float64))
    # Rules: residual projections get init_std / sqrt(2 layers); biases zero, norms one; padding zero.
    proj = init.logical_tensor("layers.2.mlp.fc2.weight", [256, 512], cfg, SEED, torch.float64)
    assert abs(proj.std().item() / (cfg.init_std / math.sqrt(2 * cfg.num_layers)) - 1) < 5 * math.sqrt(0.5 / (256 * 512))
    assert not init.logical_tensor("layers.0.mlp.fc1.bias", [64], cfg, SEED).any()
    assert (init.logical_tensor("layers.0.norm1.weight", [64], cfg, SEED) == 1).all()
    emb = init.logical_tensor("embedding.weight", [cfg.padded_vocab_size, 32], cfg, SEED)
    assert not emb[VOCAB:].any() and emb[:VOCAB].all()


def test_values_depend_on_the_index_only():
    """Chunking and the host-side bound on the indices change nothing; indices 2^32 apart differ."""
    cfg = config("gpt", 1)
    whole = init.logical_tensor("layers.0.mlp.fc2.weight", [48, 64], cfg, SEED, torch.float64)
    for dim, shards in ((0, 4), (1, 4), (1, 2)):
        for rank in range(shards):
            local = whole.chunk(shards, dim)[rank]
            out = torch.empty_like(local)
            init.fill_shard(out, "layers.0.mlp.fc2.weight", cfg, SEED, dim, rank, shards, chunk=7)
            assert torch.equal(out, local)
    keys = init.parameter_keys(SEED, "x")
    index = torch.tensor([0, 5, 2 ** 31 + 3, 2 ** 32 + 5, 2 ** 33 + 5])
    values = init.normal_at(index.clone(), keys)
    assert torch.equal(values[:3], init.normal_at(index[:3].clone(), keys, max_index=2 ** 31 + 3))
    assert len(set(values[[1, 3, 4]].tolist())) == 3


def test_a_shard_is_computed_from_its_own_elements_in_bounded_chunks():
    asked = []
    real = init.normal_at

    def watched(index, keys, max_index=None):
        asked.append(index.numel())
        return real(index, keys, max_index)

    cfg = config("llama", 4)
    ps = ParallelState(sizes={"pp": 1, "dp": 1, "cp": 1, "tp": 4}, rank=1, groups={"tp": StubGroup(4, 1)})
    with stub_groups():
        model = GPTModel(cfg, ps, device="meta")
    drawn = {n: p.numel() for n, p in model.named_parameters() if init._rule(n, cfg)[0] == "normal"}
    rows = model.embedding.weight.shape[0]  # rank 1's rows [rows, 2 rows): the real ones end at VOCAB
    for name in ("embedding.weight", "output_weight"):
        drawn[name] = (min(VOCAB, 2 * rows) - rows) * cfg.hidden_size
    with mock.patch.object(init, "normal_at", watched), mock.patch.object(init, "chunk_elements", lambda d: 1000):
        init.materialize(model, cfg, SEED, 1, 4, "cpu")
    assert max(asked) <= 1000
    assert sum(asked) == sum(drawn.values())  # this rank's elements, each once
    logical = sum(p.numel() * (4 if p.tp_partition_dim is not None else 1) for n, p in model.named_parameters()
                  if n in drawn)
    assert sum(asked) < logical / 3


def test_meta_build_leaves_nothing_on_meta_and_recomputes_rope():
    from megatron_hydra.config import derive
    from megatron_hydra.models.stages import build_model

    cfg = compose_config([*SMALL, "model.position_embedding=rope", "model.normalization=rmsnorm",
                          "model.activation=swiglu"])
    derived = derive(cfg)
    model = build_model(cfg, derived, ParallelState.single(), "cpu")
    tensors = list(model.parameters()) + list(model.buffers())
    assert tensors and all(t.device.type == "cpu" for t in tensors)
    t = derived.transformer
    d = t.kv_channels
    inv_freq = [t.rope_theta ** (-2 * i / d) for i in range(d // 2)]
    angles = torch.tensor([[p * f for f in inv_freq * 2] for p in range(t.seq_length)], dtype=torch.float64)
    for name, buf in model.named_buffers():
        expected = angles.cos() if name.endswith("cos") else angles.sin()
        assert torch.allclose(buf.double(), expected, atol=1e-6), name
    # The same values as a model built with storage and filled afterwards.
    direct = type(model)(t, ParallelState.single())
    init.init_weights(direct, t, cfg.seed, 0, 1)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), direct.parameters()))
