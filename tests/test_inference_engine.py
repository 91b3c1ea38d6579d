"""The inference engine: at tp2, pp2, tp2 + sequence parallelism and dp2 it generates, for a batch
of prompts of different lengths, the tokens of the single-process engine and of the reference
loop (``generate.generate``: one prompt alone, no padding), greedy and seeded sampling, with and
without the KV cache; it scores (context, continuation) pairs as the full forward of each sequence
alone does (float64, 1e-10); it stops each sequence at end-of-document or at its own stop
condition. Two models: GPT-2-like (learned positions, GELU) and one with the newer features
(RoPE, SwiGLU, grouped-query attention, sliding windows, capped scores and logits, QK-norm).

The weights come from the config's seed (``models.init`` is layout-free), so every layout holds
the same logical model without a checkpoint. The vocabulary (300) pads to 384 entries at tp1 and
512 at tp2, so a sampler that drew over the padding would differ between them. All multi-rank
cases run in one start of two ranks."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch

from conftest import compose_config, spawn_ranks

BASE = ["model.num_layers=3", "model.hidden_size=64", "model.num_attention_heads=4", "model.seq_length=40",
        "model.vocab_size=300", "model.init_std=0.3", "precision=fp64", "seed=5"]
MODELS = {
    "gpt2_like": BASE,
    "features": BASE + ["model.position_embedding=rope", "model.activation=swiglu", "model.num_query_groups=2",
                        "model.normalization=rmsnorm", "model.qk_norm=true", "model.sliding_window=4",
                        "model.sliding_window_pattern=2", "model.attn_logit_softcapping=4.0",
                        "model.final_logit_softcapping=3.0"],
}
LAYOUTS = {"tp2": dict(tp=2), "pp2": dict(pp=2), "tp2_sp": dict(tp=2, sp=True), "dp2": dict()}
PROMPTS = [[5, 17, 99, 3, 42], [1, 2], [7, 8, 9, 10, 11, 12, 13, 14, 15], [33], [60, 61, 62]]
NEW = 10
SEED = 11
# (context, continuation); the last one is longer than the model's 40 positions (cut on the left).
REQUESTS = [([1, 2, 3], [4, 5]), ([9], [8, 7, 6, 5]), ([3, 4, 5, 6, 7], [1]), ([12, 13], [14, 15, 16]),
            ([(7 * i) % 190 + 1 for i in range(45)], [3, 9])]
BATCH = 3  # so that both prompt batches and the pipeline's micro-batches mix lengths


def _sampling(greedy: bool):
    from megatron_hydra.config.schema import SamplingConfig

    return SamplingConfig(greedy=True) if greedy else SamplingConfig(temperature=0.9, top_k=50, top_p=0.9)


def _config(model: str):
    return compose_config(MODELS[model])


def _stop_at_three(i: int, tokens) -> bool:
    """A per-sequence condition that every rank evaluates alike (lm-eval's ``until``)."""
    return len(tokens) >= 3 + i % 2


def _requests(greedy):
    """REQUESTS, and two whose continuations are the model's greedy tokens (all greedy choices)."""
    return REQUESTS + [(PROMPTS[0], greedy[0][:3]), (PROMPTS[2], greedy[2][:2])]


def _jobs(engine, eod, requests):
    """Everything asked of each engine, by name."""
    from megatron_hydra.inference import engine as engine_module

    out = {}
    for greedy in (True, False):
        for cache in (True, False):
            out["greedy" if greedy else "sampled", cache] = engine.generate(PROMPTS, NEW, _sampling(greedy), SEED,
                                                                            use_cache=cache)
    out["eod"] = engine.generate(PROMPTS, NEW, _sampling(False), SEED, eod=eod)
    out["stop"] = engine.generate(PROMPTS, NEW, _sampling(False), SEED, stop=_stop_at_three)
    with mock.patch.object(engine_module, "SCORE_CHUNK", 4):  # rows split over several chunks
        out["scores"] = engine.score(requests)
    return out


def _single(model: str):
    """The whole model in this process, and its engine."""
    from megatron_hydra.checkpoint.standalone import single_process
    from megatron_hydra.inference.engine import Engine
    from megatron_hydra.models.stages import build_model
    from megatron_hydra.parallel.state import ParallelState

    cfg, derived = single_process(_config(model))
    whole = build_model(cfg, derived, ParallelState.single(), "cpu").eval()
    return whole, Engine([whole], ParallelState.single(), derived.transformer, batch_size=BATCH)


def _layout_engine(cfg, world: int, tp: int = 1, pp: int = 1, sp: bool = False):
    from megatron_hydra.config import derive
    from megatron_hydra.inference.engine import Engine
    from megatron_hydra.models.stages import build_stage_chunks
    from megatron_hydra.parallel.state import ParallelState

    cfg = copy.deepcopy(cfg)
    par = cfg.parallel
    par.tensor_parallel_size, par.pipeline_parallel_size, par.sequence_parallel = tp, pp, sp
    par.layers_per_stage = [2, 1] if pp == 2 else None
    cfg.trainer.devices = world
    cfg.data.micro_batch_size, cfg.data.global_batch_size = 1, 4  # enough micro-batches for any layout
    derived = derive(cfg)
    ps = ParallelState.build(tp=tp, pp=pp, dp=derived.dp)
    chunks, _ = build_stage_chunks(cfg, derived, ps)
    return chunks[0], Engine(chunks, ps, derived.transformer, batch_size=BATCH)


def _all_layouts(rank, world, configs, asks):
    out = {}
    for model, cfg in configs.items():
        for name, layout in LAYOUTS.items():
            chunk, engine = _layout_engine(cfg, world, **layout)
            chunk.train()  # the live training model: the engine restores its mode and layout
            before = {m: (getattr(m, "sequence_parallel", None), getattr(m, "cfg", None)) for m in chunk.modules()}
            out[model, name] = _jobs(engine, *asks[model])
            after = {m: (getattr(m, "sequence_parallel", None), getattr(m, "cfg", None)) for m in chunk.modules()}
            out[model, name, "restored"] = chunk.training and before == after
    return out


@pytest.fixture(scope="module")
def single():
    """Per model: the whole model and the single-process engine's answers."""
    out = {}
    for model in MODELS:
        whole, engine = _single(model)
        free = engine.generate(PROMPTS, NEW, _sampling(False), SEED)
        eod = free[0][4]  # a token the first prompt samples: its sequence ends before it
        requests = _requests(engine.generate(PROMPTS, NEW, _sampling(True)))
        out[model] = whole, (eod, requests), _jobs(engine, eod, requests)
    return out


@pytest.fixture(scope="module")
def layouts(single):
    configs = {model: _config(model) for model in MODELS}
    return spawn_ranks(_all_layouts, 2, configs, {model: single[model][1] for model in MODELS})


def _reference_loop(whole, greedy: bool, eod=None):
    """``generate.generate``, the loop the engine replaces: one prompt at a time, no padding,
    prompt i drawing from its own generator seeded with SEED + i."""
    from megatron_hydra.generate import generate

    return [generate(whole, p, NEW, _sampling(greedy), eod, torch.Generator().manual_seed(SEED + i))
            for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("model", MODELS)
def test_single_process_engine_equals_reference_loop(single, model):
    whole, (eod, _), got = single[model]
    for greedy in (True, False):
        ref = _reference_loop(whole, greedy)
        assert len({t for seq in ref for t in seq}) > 5  # real sequences, not one repeated token
        assert got["greedy" if greedy else "sampled", True] == ref
        assert got["greedy" if greedy else "sampled", False] == ref
    assert got["greedy", True] != got["sampled", True]
    free = got["sampled", True]
    assert got["eod"] == _reference_loop(whole, False, eod=eod)
    assert got["eod"] == [seq[:seq.index(eod)] if eod in seq else seq for seq in free] and len(got["eod"][0]) < NEW
    assert got["stop"] == [seq[:3 + i % 2] for i, seq in enumerate(free)]


def _independent_scores(whole, requests):
    """Each sequence alone through the whole model: float64 log-softmax of the real vocabulary,
    summed over the continuation, and whether every continuation token is the argmax."""
    out = []
    vocab = whole.cfg.vocab_size
    with torch.no_grad():
        for context, continuation in requests:
            seq = (context + continuation)[-(whole.cfg.seq_length + 1):]
            logp = whole(torch.tensor([seq[:-1]]))[0, :, :vocab].double().log_softmax(-1)
            rows = range(len(seq) - 1 - len(continuation), len(seq) - 1)
            out.append((sum(float(logp[r, t]) for r, t in zip(rows, continuation)),
                        all(int(logp[r].argmax()) == t for r, t in zip(rows, continuation))))
    return out


def _assert_scores(got, ref):
    assert [g for _, g in got] == [g for _, g in ref]
    for (ours, _), (theirs, _) in zip(got, ref):
        assert abs(ours - theirs) <= 1e-10 * max(1.0, abs(theirs)), (ours, theirs)


@pytest.mark.parametrize("model", MODELS)
def test_single_process_scores_equal_independent_forward(single, model):
    whole, (_, requests), got = single[model]
    ref = _independent_scores(whole, requests)
    assert any(g for _, g in ref) and not all(g for _, g in ref)  # both kinds of greedy flag occur
    _assert_scores(got["scores"], ref)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", MODELS)
def test_layout_equals_single_process(single, layouts, model, layout):
    whole, (_, requests), ref = single[model]
    for rank in (0, 1):  # every rank returns every result
        got = layouts[rank][model, layout]
        assert layouts[rank][model, layout, "restored"]
        for key in ref:
            if key == "scores":
                _assert_scores(got[key], _independent_scores(whole, requests))
            else:
                assert got[key] == ref[key], (rank, key)


def test_bad_layouts_and_prompts_are_refused():
    from megatron_hydra.config.schema import SamplingConfig
    from megatron_hydra.errors import ConfigError
    from megatron_hydra.inference.engine import Engine
    from megatron_hydra.parallel.state import ParallelState

    whole, engine = _single("gpt2_like")
    with pytest.raises(ConfigError, match="virtual_pipeline_size=2"):
        Engine([whole, whole], ParallelState.single(), whole.cfg)
    with pytest.raises(ConfigError, match="context_parallel_size=2"):
        Engine([whole], ParallelState(sizes={"pp": 1, "dp": 1, "cp": 2, "tp": 1}), whole.cfg)
    with pytest.raises(ConfigError, match="exceeds the model's 40 positions"):
        engine.generate([[1] * 35], 6, SamplingConfig(greedy=True))
    with pytest.raises(ConfigError, match="a prompt is empty"):
        engine.generate([[1], []], 2, SamplingConfig(greedy=True))
    with pytest.raises(ConfigError, match="sampling.top_p"):
        engine.generate([[1]], 2, SamplingConfig(top_p=2.0))


def test_row_generators_draw_as_each_row_alone():
    """Row i of a batch samples what it samples alone from the same generator: a prompt's tokens
    do not depend on its batch."""
    from megatron_hydra.config.schema import SamplingConfig
    from megatron_hydra.inference.sampling import sample_next

    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    s = SamplingConfig(temperature=1.3, top_k=10, top_p=0.95)
    batched = sample_next(logits, s, [torch.Generator().manual_seed(100 + i) for i in range(4)])
    alone = [int(sample_next(logits[i:i + 1], s, torch.Generator().manual_seed(100 + i))) for i in range(4)]
    assert batched.tolist() == alone
    draws = torch.stack([sample_next(logits, s, [torch.Generator().manual_seed(k * 4 + i) for i in range(4)])
                         for k in range(50)])
    assert all(len(set(draws[:, i].tolist())) > 1 for i in range(4))  # the seeds matter
