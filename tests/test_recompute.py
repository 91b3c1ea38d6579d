"""Activation recompute changes memory, never numbers: losses and every gradient are bitwise those
of the run without recompute (fp32), with dropout off and on, in one process, under TP and SP,
and through the pipeline schedules. The reference is the same model run without recompute.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import pytest
import torch

from conftest import SMALL, compose_config, run_training, spawn_ranks
from megatron_hydra.config import derive
from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.errors import ConfigError
from megatron_hydra.models.gpt import GPTModel
from megatron_hydra.models.init import init_weights
from megatron_hydra.parallel import recompute
from megatron_hydra.parallel.random import seed_model_parallel
from megatron_hydra.parallel.state import ParallelState

BASE = TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=4, kv_channels=8,
                         ffn_hidden_size=128, seq_length=16, max_position_embeddings=16, vocab_size=100,
                         padded_vocab_size=256)
SETTINGS = {
    "full_uniform_1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full_uniform_2": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "full_block_3": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=3),
    "selective": dict(recompute_granularity="selective"),
}
DROPOUT = dict(hidden_dropout=0.1, attention_dropout=0.1)



def _steps(cfg: TransformerConfig, ps: ParallelState, steps: int = 2):
    """Losses, every gradient and the bytes saved for backward of ``steps`` forward/backward
    passes (fresh model, fixed seeds, so two configs see the same data and random streams)."""
    seed_model_parallel(7, ps.tp_rank)
    model = GPTModel(cfg, ps)
    init_weights(model, cfg, 3, ps.tp_rank, ps.tp_size)
    model.train()
    gen = torch.Generator().manual_seed(0)
    results = []
    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=gen)
        labels = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=gen)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.untyped_storage()) or t, lambda t: t):
            loss = model(tokens, labels).mean()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        results.append((loss.detach(), grads, sum({s.data_ptr(): s.nbytes() for s in saved}.values())))
    return results


def _assert_bitwise(ours, ref):
    assert len(ours) == len(ref)
    for (loss, grads, _), (ref_loss, ref_grads, _) in zip(ours, ref):
        assert torch.equal(loss, ref_loss)
        assert grads.keys() == ref_grads.keys()
        for name in grads:
            assert torch.equal(grads[name], ref_grads[name]), name


@functools.lru_cache(maxsize=None)
def _single_process_reference(dropout: bool):
    """The run without recompute, computed once for every setting (``_steps`` seeds everything)."""
    return _steps(dataclasses.replace(BASE, **(DROPOUT if dropout else {})), ParallelState.single())


@pytest.mark.parametrize("dropout", [False, True], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_recompute_is_bitwise_exact(setting, dropout):
    base = dataclasses.replace(BASE, **(DROPOUT if dropout else {}))
    ref = _single_process_reference(dropout)
    ours = _steps(dataclasses.replace(base, **SETTINGS[setting]), ParallelState.single())
    _assert_bitwise(ours, ref)
    assert ours[0][2] < ref[0][2]  # and it did keep fewer bytes for backward


def test_dropout_replay_needs_the_tp_stream_restored(monkeypatch):
    """Negative control: replaying with only torch's own RNG handling (the default generator)
    draws new attention-dropout masks from the TP stream, and the gradients differ."""
    base = dataclasses.replace(BASE, **DROPOUT)
    ref = _steps(base, ParallelState.single(), steps=1)
    monkeypatch.setattr(recompute, "_contexts", lambda: (contextlib.nullcontext(), contextlib.nullcontext()))
    ours = _steps(dataclasses.replace(base, **SETTINGS["selective"]), ParallelState.single(), steps=1)
    assert torch.equal(ours[0][0], ref[0][0])  # forward untouched
    assert any(not torch.equal(ours[0][1][n], ref[0][1][n]) for n in ref[0][1])


def test_recomputed_chunks():
    assert recompute.recomputed_chunks(4, "full", "uniform", 2) == [(0, 2, True), (2, 4, True)]
    assert recompute.recomputed_chunks(4, "full", "block", 3) == [(0, 1, True), (1, 2, True), (2, 3, True), (3, 4, False)]
    assert recompute.recomputed_chunks(4, "selective", "uniform", 1) == [(0, 4, False)]
    assert recompute.recomputed_chunks(0, None, "uniform", 1) == []


TP_SETTINGS = ("full_uniform_2", "full_block_3", "selective")


def _tp_rank_fn(rank, world):
    """Both TP cases (without and with sequence parallelism) in one start of the ranks."""
    ps = ParallelState.build(tp=world)
    out = {}
    for sp in (False, True):
        base = dataclasses.replace(BASE, sequence_parallel=sp, **DROPOUT)
        ref = _steps(base, ps)
        for name in TP_SETTINGS:
            ours = _steps(dataclasses.replace(base, **SETTINGS[name]), ps)
            try:
                _assert_bitwise(ours, ref)
                out[sp, name] = True
            except AssertionError as e:
                out[sp, name] = f"{e}"
    return out


@pytest.fixture(scope="module")
def tp_results():
    return spawn_ranks(_tp_rank_fn, 2)


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
def test_recompute_bitwise_under_tensor_parallel(sp, tp_results):
    assert sorted(tp_results) == [0, 1]
    for results in tp_results.values():
        assert {name: results[sp, name] for name in TP_SETTINGS} == {name: True for name in TP_SETTINGS}


# Through the launch path: pipeline schedules, DP, the Lightning loop ------------------------------

# Two steps: the second one's dropout masks and weights follow a step that replayed regions.
PIPE = [*SMALL, "model.num_layers=4", "trainer.max_steps=2", "model.hidden_dropout=0.1", "model.attention_dropout=0.1",
        "checkpoint.save_last=false"]
PP2 = ["parallel=pp2", "trainer.devices=2"]
VPP2 = [*PP2, "parallel.virtual_pipeline_size=2"]
# The zero-bubble schedules split backward into input and weight grads: a region is replayed twice.
PIPE_CASES = {
    "pp2_1f1b-full_block_1": [*PP2, "recompute.granularity=full", "recompute.method=block", "recompute.num_layers=1"],
    "pp2_vpp2_zero_bubble-full_uniform_1": [*VPP2, "parallel.pipeline_schedule=zero_bubble", "recompute.granularity=full"],
    "pp2_zbv-selective": [*VPP2, "parallel.pipeline_schedule=zbv", "recompute.granularity=selective"],
}


@pytest.mark.parametrize("case", list(PIPE_CASES))
def test_recompute_bitwise_through_the_pipeline(case, tmp_path):
    overrides = PIPE_CASES[case]
    layout = [o for o in overrides if not o.startswith("recompute.")]
    keys = ("loss", "grad_norm")
    ref = run_training([*PIPE, *layout], tmp_path / "none")
    rows = run_training([*PIPE, *overrides], tmp_path / "recompute")
    assert [[r[k] for k in keys] for r in rows] == [[r[k] for k in keys] for r in ref]
    assert len(rows) == 2


# Validation ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (["recompute.granularity=everything"], "recompute.granularity='everything' is not supported"),
    (["recompute.granularity=full", "recompute.method=sometimes"], "recompute.method='sometimes' is not supported"),
    (["recompute.granularity=full", "recompute.num_layers=0"], "recompute.num_layers=0 must be a positive integer"),
    (["recompute.granularity=full", "recompute.method=block", "recompute.num_layers=3", "parallel=pp2",
      "trainer.devices=2"], "recompute.num_layers=3 exceeds the 2 layers of a pipeline stage"),
    (["recompute.granularity=full", "recompute.num_layers=3"], "recompute.num_layers=3 must divide the layers of every pipeline stage [4]"),
])
def test_bad_recompute_settings_are_one_line_errors(overrides, message):
    cfg = compose_config([*SMALL, "model.num_layers=4", *overrides])
    with pytest.raises(ConfigError) as err:
        derive(cfg)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_settings_reach_the_model():
    t = derive(compose_config([*SMALL, "model.num_layers=4", "recompute.granularity=full", "recompute.method=block",
                               "recompute.num_layers=2"])).transformer
    assert (t.recompute_granularity, t.recompute_method, t.recompute_num_layers) == ("full", "block", 2)
