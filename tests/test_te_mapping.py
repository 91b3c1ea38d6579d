"""The Transformer Engine implementation (model.transformer_impl=transformer_engine), as far as a
CPU without Transformer Engine can check it.

- From shapes alone (meta device): the TE parameters map onto the local layers' logical names and
  shapes one to one, for GPT-125M- and Llama-3-8B-shaped blocks at tp 1 and 2.
- Through a test double of ``transformer_engine.pytorch`` (tests/doubles: TE's constructor
  signatures, plain-torch forward): a checkpoint saved with the local layers fills every TE
  parameter (and its Adam state) with what the mapping says, checked against hand-written
  expectations too, and local -> TE -> local is the identity; TE and local logits, gradients,
  attention dropout and KV-cache generation agree at tp=1 (fp64); at tp=2 on two gloo ranks, with
  and without sequence parallelism, TE's loss and every gradient shard equal the single-process
  model's, its tp=2 checkpoint loads into the single-process local model exactly, and FP8
  autocast gets the recipe and the dp x tp amax group.
- The config and preflight errors of the switches.

What only a GPU proves (real TE kernels, FP8 numerics) is tests/test_gpu_te.py's.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import gpu_doubles
from conftest import compose_config, spawn_ranks
from megatron_hydra.config import derive
from megatron_hydra.errors import ConfigError

SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.seq_length=32",
         "model.vocab_size=500", "precision=fp64", "data=synthetic"]
# GPT-2/3 style (learned positions, LayerNorm, gelu, biases, tied) and Llama style (rope, RMSNorm,
# SwiGLU, grouped-query attention, no biases, untied).
VARIANTS = {
    "gpt": [],
    "llama": ["model.position_embedding=rope", "model.normalization=rmsnorm", "model.activation=swiglu",
              "model.num_query_groups=2", "model.add_bias_linear=false", "model.tie_embeddings=false",
              "model.ffn_hidden_size=160"],
}


def _tcfg(overrides, tp=1):
    return derive(compose_config([*overrides, f"parallel.tensor_parallel_size={tp}", f"trainer.devices={tp}"])).transformer


def _te(tcfg, **changes):
    """The same model on Transformer Engine (built directly: derive refuses TE in float64, which
    the double computes in so that comparisons hold at 1e-12)."""
    return dataclasses.replace(tcfg, transformer_impl="transformer_engine", **changes)


def _gpt(tcfg, ps, seed=None, device="cpu"):
    from megatron_hydra.models.gpt import GPTModel
    from megatron_hydra.models.init import init_weights

    model = GPTModel(tcfg, ps, device=device)
    if seed is not None:
        init_weights(model, tcfg, seed, ps.tp_rank, ps.tp_size)
    return model


def _logical(model, grads=False):
    from megatron_hydra.models.backends import logical_parameters

    out = {}
    for lp in logical_parameters(model):
        t = lp.param.grad if grads else lp.param.detach()
        out[lp.name] = t if lp.rows is None else t[lp.rows]
    return out


@pytest.fixture
def te_double():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread, no waiting for a busy second core
    with gpu_doubles.installed():
        import transformer_engine.pytorch as te

        te.AUTOCASTS.clear()
        yield te
    torch.set_num_threads(threads)


# The mapping, from shapes alone -------------------------------------------------------------------

@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("model", ["gpt_125m", "llama3_8b"])
def test_te_names_and_shapes_map_one_to_one_onto_the_local_ones(te_double, model, tp):
    from megatron_hydra.models.backends import logical_parameters
    from megatron_hydra.parallel.state import AXES, ParallelState

    base = [f"model={model}", "model.num_layers=2"]
    local = {lp.name: list(lp.tensor.shape) for lp in logical_parameters(_gpt(_tcfg(base), ParallelState.single(),
                                                                               device="meta"))}
    # TE's documented rule without process groups: tp_group=None with tp_size=2 gives tp=2 shapes.
    ps = ParallelState(sizes={**{a: 1 for a in AXES}, "tp": tp})
    te_model = _gpt(_te(_tcfg(base, tp)), ps, device="meta")
    te_params = dict(te_model.named_parameters())
    assert "layers.1.attention.qkv.layer_norm_weight" in te_params and "layers.1.norm1.weight" not in te_params
    logical = []
    for lp in logical_parameters(te_model):
        if not lp.name.startswith(("layers.", "final_norm.")):
            continue  # embeddings are the local layers' (and without a group, unsharded)
        assert hasattr(lp.param, "tp_partition_dim") and hasattr(lp.param, "sequence_parallel"), lp.name
        shape = list(lp.tensor.shape)
        if lp.param.tp_partition_dim is not None:
            shape[lp.param.tp_partition_dim] *= tp
        logical.append((lp.name, shape))
    names = [n for n, _ in logical]
    assert len(names) == len(set(names)), "two TE tensors claim one logical name"
    assert dict(logical) == {n: s for n, s in local.items() if n.startswith(("layers.", "final_norm."))}
    # Every TE parameter is accounted for: its rows are exactly its logical parts.
    for name, p in te_params.items():
        if name.startswith("layers."):
            own, parts = p.logical
            assert name.endswith(own) and p.shape[0] % len(parts) == 0


# Checkpoints ------------------------------------------------------------------------------------

def _optimizer(model):
    from megatron_hydra.parallel.data_parallel import GradBuffer
    from megatron_hydra.parallel.optimizer import MegatronOptimizer
    from megatron_hydra.parallel.state import ParallelState

    buffer = GradBuffer(model.parameters(), None, 10**8)
    return MegatronOptimizer(model, buffer, ParallelState.single(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                             weight_decay=0.1, clip_grad=0.0)


def _save(path, model, opt, vocab):
    from megatron_hydra.checkpoint.sharded import save
    from megatron_hydra.parallel.state import ParallelState

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        save(str(path), model, opt, ParallelState.single(), vocab, {"step": 1, "consumed_samples": 8, "shapes": {}},
             rng_states=False)


def _load(path, model, opt, vocab):
    from megatron_hydra.checkpoint.sharded import load
    from megatron_hydra.parallel.state import ParallelState

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        load(str(path), model, opt, ParallelState.single(), vocab, load_optimizer=opt is not None)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_local_checkpoint_fills_the_te_names_and_comes_back(te_double, tmp_path, variant):
    from megatron_hydra.models.init import VOCAB_TABLES
    from megatron_hydra.parallel.state import ParallelState

    tcfg, ps = _tcfg([*SMALL, *VARIANTS[variant]]), ParallelState.single()
    local = _gpt(tcfg, ps, seed=1)
    opt = _optimizer(local)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # distinct values everywhere (norm weights are ones, biases zeros at init)
        for name, p in local.named_parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
            p.main_grad.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
            if name in VOCAB_TABLES:  # padding rows stay zero, as in training
                p[tcfg.vocab_size:] = 0
                p.main_grad[tcfg.vocab_size:] = 0
    opt.step()
    _save(tmp_path / "local", local, opt, tcfg.vocab_size)

    te_model = _gpt(_te(tcfg), ps, seed=2)
    te_opt = _optimizer(te_model)
    _load(tmp_path / "local", te_model, te_opt, tcfg.vocab_size)
    ours = dict(local.named_parameters())
    theirs = dict(te_model.named_parameters())
    # By hand, the tensors the mapping must get right.
    expected = {"layers.0.attention.qkv.layer_norm_weight": ["layers.0.norm1.weight"],
                "layers.1.mlp.fc1.layer_norm_weight": ["layers.1.norm2.weight"],
                "layers.0.attention.qkv.weight": ["layers.0.attention.qkv.weight"],
                "layers.1.mlp.fc2.weight": ["layers.1.mlp.fc2.weight"], "final_norm.weight": ["final_norm.weight"]}
    if variant == "llama":  # SwiGLU: TE's fc1 holds gate then up
        expected["layers.0.mlp.fc1.weight"] = ["layers.0.mlp.gate.weight", "layers.0.mlp.fc1.weight"]
    else:
        expected.update({"layers.0.mlp.fc1.layer_norm_bias": ["layers.0.norm2.bias"],
                         "layers.1.attention.proj.bias": ["layers.1.attention.proj.bias"],
                         "layers.0.mlp.fc1.weight": ["layers.0.mlp.fc1.weight"]})
    for te_name, local_names in expected.items():
        assert torch.equal(theirs[te_name], torch.cat([ours[n] for n in local_names])), te_name
    # Through the mapping: every TE parameter, and Adam's state of each.
    for name, p in theirs.items():
        own, parts = getattr(p, "logical", (name, (name,)))
        prefix = name[: len(name) - len(own)]
        sources = [ours[prefix + part] for part in parts]
        assert torch.equal(p, torch.cat(sources)), name
        for key in ("exp_avg", "exp_avg_sq"):
            want = torch.cat([opt.inner.state[s][key] for s in sources])
            assert torch.equal(te_opt.inner.state[p][key], want), (name, key)
        assert te_opt.inner.state[p]["step"] == 1
    # And back: TE -> local is the identity.
    _save(tmp_path / "te", te_model, te_opt, tcfg.vocab_size)
    back = _gpt(tcfg, ps, seed=3)
    back_opt = _optimizer(back)
    _load(tmp_path / "te", back, back_opt, tcfg.vocab_size)
    for name, p in back.named_parameters():
        assert torch.equal(p, ours[name]), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(back_opt.inner.state[p][key], opt.inner.state[ours[name]][key]), (name, key)


# The TE wiring through the double ----------------------------------------------------------------

@pytest.mark.parametrize("variant", list(VARIANTS))
def test_te_logits_gradients_and_generation_equal_local(te_double, variant):
    from megatron_hydra.generate import SamplingConfig, generate
    from megatron_hydra.parallel.state import ParallelState

    tcfg, ps = _tcfg([*SMALL, *VARIANTS[variant]]), ParallelState.single()
    local, te_model = _gpt(tcfg, ps, seed=5), _gpt(_te(tcfg), ps, seed=5)
    ref = _logical(local)
    assert all(torch.equal(t, ref[n]) for n, t in _logical(te_model).items())  # init by logical name
    gen = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, tcfg.vocab_size, (2, tcfg.seq_length), generator=gen) for _ in range(2))
    v = tcfg.vocab_size
    torch.testing.assert_close(te_model(tokens)[..., :v], local(tokens)[..., :v], rtol=1e-12, atol=1e-12)
    for model in (local, te_model):
        model(tokens, labels).mean().backward()
    ours, theirs = _logical(local, grads=True), _logical(te_model, grads=True)
    assert set(ours) == set(theirs)
    for name in ours:
        torch.testing.assert_close(theirs[name], ours[name], rtol=1e-10, atol=1e-12, msg=name)
    greedy = SamplingConfig(greedy=True)
    assert generate(te_model, [3, 1, 4], 8, greedy) == generate(local, [3, 1, 4], 8, greedy)
    assert te_double.AUTOCASTS == []  # no FP8 asked for


def test_te_attention_dropout_draws_from_the_tp_sharded_stream(te_double):
    # DotProductAttention gets our TP-sharded stream as its RNG tracker: the same masks as the
    # local attention's. (Hidden dropout is ours in both; it draws on [s, b, h] instead of
    # [b, s, h] on TE, so its masks are other, equally distributed ones.)
    from megatron_hydra.parallel.random import seed_model_parallel
    from megatron_hydra.parallel.state import ParallelState

    tcfg, ps = dataclasses.replace(_tcfg([*SMALL, *VARIANTS["llama"]]), attention_dropout=0.2), ParallelState.single()
    local, te_model = _gpt(tcfg, ps, seed=3), _gpt(_te(tcfg), ps, seed=3)
    tokens = torch.randint(0, tcfg.vocab_size, (2, tcfg.seq_length), generator=torch.Generator().manual_seed(0))
    logits = []
    for model in (local, te_model):
        seed_model_parallel(5, 0)
        logits.append(model(tokens)[..., :tcfg.vocab_size])
    seed_model_parallel(6, 0)
    other = local(tokens)[..., :tcfg.vocab_size]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(other, logits[0])  # dropout did draw


def test_fp8_autocast_wraps_the_stack_with_the_configured_recipe(te_double):
    from transformer_engine.common import recipe

    from megatron_hydra.config.transformer_config import FP8Recipe
    from megatron_hydra.generate import SamplingConfig, generate
    from megatron_hydra.parallel.state import ParallelState

    tcfg, ps = _tcfg([*SMALL, *VARIANTS["llama"]]), ParallelState.single()
    spec = FP8Recipe(recipe="delayed", format="e4m3", amax_history_len=16, amax_compute_algo="most_recent", margin=1)
    model = _gpt(_te(tcfg, fp8=spec), ps, seed=1)
    model(torch.zeros(2, tcfg.seq_length, dtype=torch.long))
    (enabled, used, group), = te_double.AUTOCASTS
    assert enabled and group is None  # one process: no amax group
    assert used == recipe.DelayedScaling(fp8_format=recipe.Format.E4M3, margin=1, amax_history_len=16,
                                         amax_compute_algo="most_recent")
    generate(model, [1, 2], 3, SamplingConfig(greedy=True))
    assert len(te_double.AUTOCASTS) == 1  # generation's one-token steps run without FP8
    model = _gpt(_te(tcfg, fp8=FP8Recipe(recipe="current")), ps, seed=1)
    model(torch.zeros(1, tcfg.seq_length, dtype=torch.long))
    assert te_double.AUTOCASTS[-1][1] == recipe.Float8CurrentScaling(fp8_format=recipe.Format.HYBRID)
    del recipe.Float8CurrentScaling  # an older Transformer Engine
    with pytest.raises(ConfigError, match="precision.fp8.recipe=current"):
        _gpt(_te(tcfg, fp8=FP8Recipe(recipe="current")), ps)


def _tp2_rank(rank, world, variant, sequence_parallel, path):
    gpu_doubles.install()
    import torch.distributed as dist
    import transformer_engine.pytorch as te

    from megatron_hydra.config.transformer_config import FP8Recipe
    from megatron_hydra.parallel.data_parallel import allreduce_sequence_parallel_grads
    from megatron_hydra.parallel.state import ParallelState

    torch.set_num_threads(1)
    tcfg1 = _tcfg([*SMALL, *VARIANTS[variant]])
    ps1, ps2 = ParallelState.single(), ParallelState.build(tp=2)
    tcfg2 = _te(_tcfg([*SMALL, *VARIANTS[variant]], tp=2), sequence_parallel=sequence_parallel, fp8=FP8Recipe())
    local, te_model = _gpt(tcfg1, ps1, seed=5), _gpt(tcfg2, ps2, seed=5)
    gen = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, tcfg1.vocab_size, (2, tcfg1.seq_length), generator=gen) for _ in range(2))
    want = local(tokens, labels)
    got = te_model(tokens, labels)
    want.mean().backward()
    got.mean().backward()
    params = [p for p in te_model.parameters()]
    allreduce_sequence_parallel_grads(params, ps2.tp_group, [p.grad for p in params])
    full = _logical(local, grads=True)
    errors = {"loss": (got - want).abs().max().item()}
    from megatron_hydra.models.backends import logical_parameters

    for lp in logical_parameters(te_model):
        dim = lp.param.tp_partition_dim
        grad = lp.param.grad if lp.rows is None else lp.param.grad[lp.rows]
        ref = full[lp.name]
        if lp.name in ("embedding.weight", "output_weight"):
            ref = torch.cat([ref, ref.new_zeros(grad.shape[0] * 2 - ref.shape[0], ref.shape[1])])
        if dim is not None:
            ref = ref.chunk(2, dim=dim)[rank]
        errors[lp.name] = (grad - ref).abs().max().item()
    (enabled, _, group), = te.AUTOCASTS
    # Saved by TE at tp=2 (SwiGLU's fc1: each rank's [gate shard; up shard]), loaded whole by
    # the local layers: the single-process model's weights, bit for bit.
    from megatron_hydra.checkpoint.sharded import load, save

    save(path, te_model, None, ps2, tcfg1.vocab_size, {"step": 0, "consumed_samples": 0, "shapes": {}},
         rng_states=False)
    back = _gpt(tcfg1, ps1, seed=6)
    load(path, back, None, ps1, tcfg1.vocab_size, load_optimizer=False)
    same = all(torch.equal(p, dict(local.named_parameters())[n]) for n, p in back.named_parameters())
    return errors, enabled, dist.get_process_group_ranks(group), same


@pytest.mark.parametrize("variant,sequence_parallel", [("gpt", False), ("llama", True)])
def test_te_at_tp2_equals_the_single_process_model(variant, sequence_parallel, tmp_path):
    results = spawn_ranks(_tp2_rank, 2, variant, sequence_parallel, str(tmp_path / "te_tp2"))
    assert len(results) == 2
    for errors, enabled, amax_ranks, checkpoint_loads_whole in results.values():
        assert enabled and amax_ranks == [0, 1]  # the amax group: dp x cp x tp (here tp=2)
        assert max(errors.values()) < 1e-10, {k: v for k, v in errors.items() if v >= 1e-10}
        assert checkpoint_loads_whole


# Config and preflight -----------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,message", [
    (["precision=fp8"], "set model.transformer_impl=transformer_engine"),
    (["model.transformer_impl=transformer_engine", "precision=fp64"], "no float64 kernels"),
    (["model.transformer_impl=transformer_engine", "model=bert_base", "data=indexed_bert"], "model.arch=bert"),
    (["model.transformer_impl=transformer_engine", "precision=fp8", "precision.fp8.format=e5m2"],
     "precision.fp8.format='e5m2' is not supported"),
    (["model.transformer_impl=transformer_engine", "precision=fp8", "recompute.granularity=full"],
     "recompute.granularity=selective or null"),
    (["model.transformer_impl=transformer_engine", "precision=fp8", "model.seq_length=40", "data.micro_batch_size=1"],
     "divisible by 16"),
    (["model.transformer_impl=transformer_engine", "precision=fp8", "precision.fp8.amax_history_len=0"],
     "amax_history_len=0 must be >= 1"),
    (["model.transformer_impl=te"], "model.transformer_impl='te' is not supported"),
])
def test_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        derive(compose_config(overrides))
    assert "\n" not in str(err.value)


def test_fp8_derives_into_the_model_config():
    t = derive(compose_config(["model.transformer_impl=transformer_engine", "precision=fp8",
                               "precision.fp8.recipe=current"])).transformer
    assert (t.transformer_impl, t.params_dtype, t.fp8.recipe, t.fp8.format) == ("transformer_engine", torch.bfloat16,
                                                                                  "current", "hybrid")
    assert derive(compose_config([])).transformer.fp8 is None


def test_preflight_needs_transformer_engine_and_a_gpu(tmp_path, monkeypatch):
    import importlib.util

    from megatron_hydra.launcher import run

    cfg = compose_config(["model.transformer_impl=transformer_engine", "trainer=gpu", "trainer.devices=1",
                          "trainer.max_steps=1", "optim.warmup_steps=0"],
                         str(tmp_path / "run"))
    with pytest.raises(ConfigError, match="needs NVIDIA Transformer Engine.*use model.transformer_impl=local") as err:
        run(cfg)
    assert "\n" not in str(err.value)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "transformer_engine" else real(name, *a))
    cfg.trainer.accelerator = "cpu"
    with pytest.raises(ConfigError, match="runs on GPUs: use trainer=gpu"):
        run(cfg)
