"""LoRA and DPO in the plans: the memory plan, the FLOP count, the step-time model, the dry run.

References: the adapters' and the model's sizes counted by hand from the config (A [r, in] and
B [out, r] per adapted layer, sharded as ``parallel.lora`` documents), the FLOPs of each matmul
counted by hand, and the bytes the dry run measures over fake tensors (what autograd keeps at the
end of a forward, and the state after a step, by MemTracker's categories).
"""

from __future__ import annotations

import math

import pytest

from conftest import compose_config
from megatron_hydra.config import derive
from megatron_hydra.planning.flops import model_flops_per_step
from megatron_hydra.planning.memory import plan_memory, rank_memory
from megatron_hydra.planning.performance import CALIBRATED, Layout, estimate
from megatron_hydra.training import dry_run as D
from megatron_hydra.training import fake_gpu

LLAMA = ["model.num_query_groups=2", "model.position_embedding=rope", "model.normalization=rmsnorm",
         "model.activation=swiglu", "model.add_bias_linear=false"]
RANK = 8


def _cfg(*overrides):
    cfg = compose_config(["data=synthetic", "trainer=gpu", "precision=bf16", *LLAMA, *overrides])
    return cfg, derive(cfg)


def _adapters_per_tp_rank(tc, tp: int, layers: int) -> int:
    """A [r, in] and B [out, r] of qkv (A per q, k, v), proj, fc1, gate and fc2: a column-parallel
    layer's A whole and B split by its output, a row-parallel layer's A split by its input."""
    h, f, r = tc.hidden_size, tc.ffn_hidden_size, RANK
    qkv_out, attn = (tc.num_attention_heads + 2 * tc.num_query_groups) * tc.kv_channels, tc.num_attention_heads * tc.kv_channels
    column = 3 * r * h + qkv_out * r // tp + 2 * (r * h + f * r // tp)  # qkv, fc1, gate
    row = r * attn // tp + h * r + r * f // tp + h * r  # proj, fc2
    return layers * (column + row)


def test_lora_state_is_the_frozen_base_plus_the_adapters():
    """tp2 x pp2 x dp2, bf16, distributed optimizer: the base holds its bf16 weights alone; the
    adapters their weights, fp32 grads, and 1/dp of the fp32 main copy and Adam state."""
    base = ["parallel=tp2_pp2", "trainer.devices=8", "optim.distributed_optimizer=true", "data.global_batch_size=16"]
    cfg, derived = _cfg(*base, "peft=lora", f"peft.rank={RANK}")
    full_cfg, full = _cfg(*base)
    for pp in range(2):
        row, full_row = rank_memory(cfg, derived, pp), rank_memory(full_cfg, full, pp)
        n = _adapters_per_tp_rank(derived.transformer, 2, 2)
        padded = math.ceil(n / 2) * 2  # one bucket, padded to a multiple of dp
        assert row.frozen_params == full_row.params and row.params == full_row.params + n
        assert row.weight_bytes == 2 * (full_row.params + padded)
        assert (row.grad_bytes, row.main_weight_bytes, row.optimizer_bytes) == (4 * padded, 4 * padded // 2, 8 * padded // 2)
        assert row.activation_bytes < full_row.activation_bytes  # frozen inputs are not kept
    plan = plan_memory(cfg, derived)
    table = plan.table()
    assert " trained " in table.splitlines()[1]
    note = next(n for n in plan.notes if n.startswith("peft=lora"))
    assert f"{n:,} of " in note and "with every weight trained (peft=none)" in note


def test_dpo_reference_is_a_frozen_copy_without_lora_and_nothing_with_it():
    base = ["data=preference", "objective=dpo", "trainer.devices=2", "parallel=tp2"]
    cfg, derived = _cfg(*base)
    row = rank_memory(cfg, derived, 0)
    assert row.reference_bytes == 2 * row.params + row.buffer_bytes  # bf16 weights and rotary tables
    assert row.static_bytes == rank_memory(*_cfg(*base[2:]), 0).static_bytes + row.reference_bytes
    assert rank_memory(*_cfg(*base, "peft=lora"), 0).reference_bytes == 0
    assert " reference " in plan_memory(cfg, derived).table().splitlines()[1]


def _hand_flops(tc, lora: bool, reference: bool) -> float:
    """Per token: forward matmuls 2 x multiply-adds; backward twice the forward for trained
    weights, once (input gradients only) for frozen ones; attention's two matmuls always twice."""
    h, a, g, d, f, s, l = (tc.hidden_size, tc.num_attention_heads, tc.num_query_groups, tc.kv_channels,
                           tc.ffn_hidden_size, tc.seq_length, tc.num_layers)
    linear = l * 2 * (h * (a + 2 * g) * d + a * d * h + 3 * h * f)
    attention = l * 2 * 2 * a * d * s
    head = 2 * h * tc.padded_vocab_size
    r = RANK
    adapters = l * 2 * r * ((3 * h + (a + 2 * g) * d) + (a * d + h) + 2 * (h + f) + (f + h))
    train = 2 * (linear + head) + 3 * attention + 3 * adapters if lora else 3 * (linear + attention + head)
    return train + (linear + attention + head) * reference


@pytest.mark.parametrize("lora", [False, True])
def test_model_flops_by_hand(lora):
    cfg, derived = _cfg(*(["peft=lora", f"peft.rank={RANK}"] if lora else []))
    tc = derived.transformer
    for reference in (False, True):
        tokens = 4 * tc.seq_length
        assert model_flops_per_step(tc, 4, reference) == pytest.approx(tokens * _hand_flops(tc, lora, reference), rel=1e-12)


def test_step_time_skips_frozen_weight_gradients_and_runs_the_reference_forward():
    h100 = compose_config(["cluster=h100_80g_x1024"]).cluster
    big = ["model.num_layers=8", "model.hidden_size=2048", "model.num_attention_heads=16", "model.seq_length=2048"]
    (_, full), (_, lora) = _cfg(*big), _cfg(*big, "peft=lora", f"peft.rank={RANK}")
    tf, tl = full.transformer, lora.transformer
    lay = Layout(tp=1, pp=1, dp=2, micro_batch=1, overlap_grad_reduce=False)
    m, batch = 4, 8  # micro-batches per step, global batch
    sf, sl = estimate(tf, batch, lay, h100), estimate(tl, batch, lay, h100)
    peak = h100.peak_tflops * 1e12 * CALIBRATED.matmul_eta(h100.gpu)
    h, f, a, g, d = tf.hidden_size, tf.ffn_hidden_size, tf.num_attention_heads, tf.num_query_groups, tf.kv_channels
    projections = 2 * (h * (a + 2 * g) * d + a * d * h + 3 * h * f)  # forward FLOPs per token and layer
    adapters = 2 * RANK * ((3 * h + (a + 2 * g) * d) + (a * d + h) + 2 * (h + f) + (f + h))
    tokens = tf.seq_length
    skipped = tf.num_layers * tokens * (projections - 3 * adapters) + tokens * 2 * h * tf.padded_vocab_size
    assert sf.compute - sl.compute == pytest.approx(m * skipped / peak, rel=1e-9)
    # dp all-reduce of the fp32 gradients of the adapters alone: 2 (dc-1)/dc x 4 bytes each
    params = tf.num_layers * adapters / 2
    link = h100.nvlink_gb_per_s * 1e9 * CALIBRATED.link_efficiency
    assert sl.dp_comm == pytest.approx(4 * params / link + 2 * CALIBRATED.latency_s, rel=1e-9)
    # DPO: the reference forward, a third of a trained step's compute (without LoRA); under LoRA
    # the base's forward, which is that same third of the full run's
    dpo = Layout(tp=1, pp=1, dp=2, micro_batch=1, overlap_grad_reduce=False, reference_forward=True)
    assert estimate(tf, batch, dpo, h100).compute == pytest.approx(sf.compute * 4 / 3, rel=1e-12)
    assert estimate(tl, batch, dpo, h100).compute == pytest.approx(sl.compute + sf.compute / 3, rel=1e-12)


in_this_process = pytest.mark.skipif(not fake_gpu.registered(),
                                     reason="a real accelerator is usable: the dry run runs in its own process")


def _forward_kept(monkeypatch, cfg, derived, rank=0):
    """The dry run of ``rank`` and the bytes its last forward left on the fake device (what
    autograd keeps for backward, measured around the model chunk's forward)."""
    from megatron_hydra.training import module as M

    box = {}
    tracker_of = D._memory_tracker

    def tracker():
        box["tracker"] = tracker_of()
        return box["tracker"]

    def total() -> int:
        snapshot = box["tracker"].get_tracker_snapshot("current")
        return next(v["Total"] for k, v in snapshot.items() if str(k).startswith("fakegpu"))

    init = M.LMModule.__init__

    def hooked(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.model.register_forward_pre_hook(lambda *_: box.__setitem__("before", total()))
        self.model.register_forward_hook(lambda *_: box.__setitem__("kept", total() - box["before"]))

    monkeypatch.setattr(D, "_memory_tracker", tracker)
    monkeypatch.setattr(M.LMModule, "__init__", hooked)
    (result,) = D.dry_run(cfg, derived, [rank])
    return result, box["kept"]


@in_this_process
@pytest.mark.parametrize("overrides", [
    # no qkv adapter: the first layer's attention keeps nothing; adapter and hidden dropout
    ("peft.target_modules=[proj,fc2]", "peft.dropout=0.1", "model.hidden_dropout=0.1"),
    # DPO under LoRA: every target, a packed preference batch (document masks); no reference copy
    ("data=preference", "objective=dpo"),
    # q, k and v adapters drop their input with masks of their own
    ("peft.target_modules=[qkv,fc1]", "peft.dropout=0.1"),
], ids=["proj_fc2_dropout", "dpo", "qkv_dropout"])
def test_forward_keeps_what_the_plan_says(monkeypatch, overrides):
    cfg, derived = _cfg("trainer.devices=1", "data.micro_batch_size=1", "data.global_batch_size=1",
                        "model.num_layers=2", "model.hidden_size=512", "model.num_attention_heads=8",
                        "model.seq_length=512", "model.vocab_size=256", "peft=lora", f"peft.rank={RANK}", *overrides)
    result, kept = _forward_kept(monkeypatch, cfg, derived)
    plan = rank_memory(cfg, derived, 0)
    assert kept == pytest.approx(plan.activation_bytes, rel=0.005)  # the batch's ids aside
    assert result.static_bytes == pytest.approx(plan.static_bytes, rel=0.005)


def test_8b_lora_step_holds_the_planned_state():
    """Llama 3.1 8B's shapes (2 of its layers) at tp8 x dp2, bf16, distributed optimizer, its last
    rank: MemTracker's parameters are the plan's to the byte, so is Adam's state but for its step
    counters."""
    cfg = compose_config(["model=llama3.1_8b", "model.num_layers=2", "parallel=tp8", "trainer=gpu", "trainer.devices=8",
                          "trainer.num_nodes=2", "precision=bf16", "optim.distributed_optimizer=true", "data=synthetic",
                          "data.micro_batch_size=1", "data.global_batch_size=2", "peft=lora"])
    derived = derive(cfg)
    (result,) = D.dry_run(cfg, derived, [15])
    plan = rank_memory(cfg, derived, 0)
    assert result.state_bytes["PARAM"] == plan.weight_bytes
    counters = 4 * 2 * 14  # Adam's step count, 4 bytes for each of at most 14 adapter tensors a layer (left out)
    assert 0 <= result.state_bytes["OPT"] - plan.optimizer_bytes <= counters
    assert result.static_bytes == pytest.approx(plan.static_bytes, rel=0.001)
    assert result.save_items > 0


def test_dpo_pipeline_holds_the_reference_copy_and_its_pipeline():
    """objective=dpo without LoRA at tp2 x pp2: the frozen reference copy and the stage buffers of
    the reference's own pipeline are in the state after the step, as planned."""
    cfg, derived = _cfg("data=preference", "objective=dpo", "parallel=tp2_pp2", "trainer.devices=4",
                        "data.global_batch_size=8", "data.micro_batch_size=2", "optim.distributed_optimizer=true")
    (result,) = D.dry_run(cfg, derived, [3])  # the last stage: the loss, the reference's document sums
    assert result.static_bytes == pytest.approx(result.plan_static_bytes, rel=0.005)


def test_planner_ranks_lora_jobs_by_their_own_memory_and_step_time():
    """Llama 3.1 8B on one 8-GPU H100 node: under LoRA plain data parallelism fits (the frozen base
    holds no gradient or optimizer state) and ranks first; full fine-tuning does not fit it, and is
    slower at the same layout (the weights' gradients)."""
    from megatron_hydra.planning.layouts import Options, layout_config, memory_peak, plan_layouts

    base = ["model=llama3.1_8b", "cluster=h100_80g_x1024", "data.global_batch_size=32"]
    cfg = compose_config([*base, "peft=lora"])
    cfg.cluster.num_nodes = 1
    opts = Options(micro_batches=(1,), recompute=(None,), sequence_parallel=(False,), distributed_optimizer=(False,),
                   data_parallel=("ddp",), max_cp=1)
    best = plan_layouts(cfg, cfg.cluster, opts)[0]
    assert (best.layout.tp, best.layout.pp, best.layout.cp, best.layout.dp) == (1, 1, 1, 8)
    full_cfg = layout_config(compose_config(base), cfg.cluster, best.layout)
    full = derive(full_cfg)
    assert not memory_peak(full_cfg, full)[0]
    assert estimate(full.transformer, 32, best.layout, cfg.cluster).total > best.step.total
