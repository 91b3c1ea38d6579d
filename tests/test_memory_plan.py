"""The memory plan against what a run really holds, and against the paper's formulas.

References: the bytes of the tensors a real training run allocated (parameters, gradient buffer,
optimizer state, counted on every rank after a step of the full training path), the bytes
autograd keeps for backward during a forward (a saved-tensor hook counting distinct storages),
and Korthikanti et al. 2022's closed forms typed in from the paper.
"""

from __future__ import annotations


import pytest
import torch

from conftest import SMALL, compose_config, launch_py, spawn_ranks
from megatron_hydra.config import derive
from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.errors import ConfigError
from megatron_hydra.models.transformer import Block
from megatron_hydra.parallel.random import seed_model_parallel
from megatron_hydra.parallel.recompute import run_layers
from megatron_hydra.parallel.state import ParallelState
from megatron_hydra.planning.activations import activation_bytes_per_layer
from megatron_hydra.planning.memory import plan_memory, rank_memory

# Paper formulas ------------------------------------------------------------------------------------


@pytest.mark.parametrize("s, b, h, a, t", [(2048, 1, 12288, 96, 8), (1024, 4, 768, 12, 2), (512, 2, 512, 8, 4)])
def test_defaults_are_the_papers_table(s, b, h, a, t):
    """Korthikanti et al. 2022, Table 2 (bytes per layer, 16-bit activations)."""
    f = activation_bytes_per_layer
    assert f(s, b, h, a) == pytest.approx(s * b * h * (34 + 5 * a * s / h))
    assert f(s, b, h, a, tp=t) == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    assert f(s, b, h, a, tp=t, sequence_parallel=True) == pytest.approx(s * b * h / t * (34 + 5 * a * s / h))
    assert f(s, b, h, a, tp=t, sequence_parallel=True, recompute="selective") == pytest.approx(34 * s * b * h / t)
    assert f(s, b, h, a, tp=t, recompute="full") == pytest.approx(2 * s * b * h)
    assert f(s, b, h, a, tp=t, sequence_parallel=True, recompute="full") == pytest.approx(2 * s * b * h / t)


# Bytes a real run allocates ------------------------------------------------------------------------

# One row per layout; a row is the command-line overrides of the run (fp32 unless it says).
LAYOUTS = {
    "single": [],
    "dp2": ["trainer.devices=2"],
    "tp2": ["parallel=tp2", "trainer.devices=2"],
    "pp2": ["parallel=pp2", "trainer.devices=2"],
    "tp2_pp2": ["parallel=tp2_pp2", "trainer.devices=4"],
    "dp2_distributed_optimizer": ["trainer.devices=2", "optim.distributed_optimizer=true"],
    "tp2_bf16": ["parallel=tp2", "trainer.devices=2", "precision=bf16"],
    "dp2_bf16_distributed_optimizer": ["trainer.devices=2", "precision=bf16", "optim.distributed_optimizer=true"],
}
RUN = [*SMALL, "model.num_layers=4", "trainer.max_steps=1", "optim.warmup_steps=0", "checkpoint.save_last=false"]
# Mixture of Experts: moe_tiny shrunk; its 8 experts split over ep ranks, their buckets reduced over
# dp / ep ranks. pp2 with MoE in layers 2 and 3 only: the plan must build each stage's own layers.
MOE = ["model=moe_tiny", "model.num_query_groups=2", "model.ffn_hidden_size=64", "model.moe.ffn_hidden_size=32"]
MOE_LAYOUTS = {
    "ep2": ["trainer.devices=2", "parallel.expert_parallel_size=2"],
    "ep2_distributed_optimizer": ["trainer.devices=2", "parallel.expert_parallel_size=2",
                                  "optim.distributed_optimizer=true", "parallel.grad_bucket_size=3000"],
    "ep2_dp4_bf16_distributed_optimizer": ["trainer.devices=4", "parallel.expert_parallel_size=2", "precision=bf16",
                                           "optim.distributed_optimizer=true", "parallel.grad_bucket_size=3000"],
    "pp2_shared_expert": ["parallel=pp2", "trainer.devices=2", "model.moe.layer_freq=[0,0,1,1]",
                          "model.moe.shared_ffn_hidden_size=32"],
    # Whole experts: ep2 inside each TP pair, expert buckets over the 2 ranks of each TP position.
    "tp2_dp2_whole_experts_ep2_distributed_optimizer": [
        "trainer.devices=4", "parallel.tensor_parallel_size=2", "parallel.expert_parallel_size=2",
        "parallel.expert_tensor_parallel_size=1", "optim.distributed_optimizer=true", "parallel.grad_bucket_size=3000"],
}


def _storage_bytes(tensors) -> int:
    storages = {}
    for t in tensors:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def _count_state(trainer, module) -> dict:
    """Bytes of the tensors the run holds: parameters, grads (``.grad`` or the buffer's
    ``main_grad`` views), main weights (optimizer parameters that are not model parameters) and
    Adam's moments."""
    params = list(module.parameters())
    grads = [g for p in params for g in (getattr(p, "main_grad", None), p.grad) if g is not None]
    opt = trainer.optimizers[0]
    own = {p.untyped_storage().data_ptr() for p in params}
    main = [q for group in opt.param_groups for q in group["params"] if q.untyped_storage().data_ptr() not in own]
    moments = [v for state in opt.state.values() for k, v in state.items() if k in ("exp_avg", "exp_avg_sq")]
    return {"params": sum(p.numel() for p in params), "weight_bytes": _storage_bytes(params),
            "grad_bytes": _storage_bytes(grads), "main_weight_bytes": _storage_bytes(main),
            "optimizer_bytes": _storage_bytes(moments)}


def _real_run_rank(rank, world, overrides, run_dir):
    import pytorch_lightning as pl

    from megatron_hydra.training import train as train_module

    counted = {}

    class Count(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            counted.update(_count_state(trainer, pl_module))

    build = train_module.build_trainer

    def with_counter(*args, **kwargs):
        trainer = build(*args, **kwargs)
        trainer.callbacks.append(Count())
        return trainer

    train_module.build_trainer = with_counter
    cfg = compose_config(overrides, run_dir)
    derived = derive(cfg)
    train_module.train(cfg, derived, local_rank=rank)
    ps = ParallelState(sizes={"pp": derived.pp, "dp": derived.dp, "cp": 1, "tp": derived.tp}, rank=rank)
    planned = rank_memory(cfg, derived, ps.pp_rank)
    return counted, {k: getattr(planned, k) for k in counted}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_plan_equals_the_bytes_a_run_allocates(layout, tmp_path):
    overrides = [*RUN, *LAYOUTS[layout]]
    world = derive(compose_config(overrides)).world_size
    results = spawn_ranks(_real_run_rank, world, overrides, str(tmp_path))
    assert sorted(results) == list(range(world))
    for rank, (counted, planned) in results.items():
        assert counted == planned, f"rank {rank}"
        dp = 2 if "optim.distributed_optimizer=true" in overrides else 1  # Adam state for 1/dp of the weights
        # Adam's two fp32 moments for 1/dp of the parameters (bucket padding aside)
        assert counted["optimizer_bytes"] == pytest.approx(8 * counted["params"] / dp, abs=8 * dp)


@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_moe_plan_equals_the_bytes_a_run_allocates(layout, tmp_path):
    overrides = [*RUN, *MOE, *MOE_LAYOUTS[layout]]
    world = derive(compose_config(overrides)).world_size
    results = spawn_ranks(_real_run_rank, world, overrides, str(tmp_path))
    assert sorted(results) == list(range(world))
    for rank, (counted, planned) in results.items():
        assert counted == planned, f"rank {rank}"


# Activations measured against the formulas ---------------------------------------------------------

# GPT-like: ffn = 4h; 5as/h = 40 of 74 units. Head size 32: the terms' proportions of h = s = 512 with
# head size 64, at an eighth of its compute.
H, HEADS, SEQ, MICRO = 256, 8, 256, 2


def _block_config(dropout: float, granularity=None, tp: int = 1, sp: bool = False) -> TransformerConfig:
    return TransformerConfig(num_layers=2, hidden_size=H, num_attention_heads=HEADS, num_query_groups=HEADS,
                             kv_channels=H // HEADS, ffn_hidden_size=4 * H, seq_length=SEQ, max_position_embeddings=SEQ,
                             vocab_size=100, padded_vocab_size=128 * tp, hidden_dropout=dropout, attention_dropout=dropout,
                             recompute_granularity=granularity, sequence_parallel=sp)


def measured_bytes_per_layer(cfg: TransformerConfig, ps: ParallelState, layers: int = 2) -> float:
    """Distinct storages autograd keeps for backward over a forward of ``layers`` blocks, the
    parameters excluded, per layer."""
    seed_model_parallel(1, ps.tp_rank)
    blocks = [Block(cfg, ps) for _ in range(layers)]
    for block in blocks:
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.02)
        block.train()
    weights = {p.untyped_storage().data_ptr() for block in blocks for p in block.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    seq = SEQ // ps.tp_size if cfg.sequence_parallel else SEQ
    x = torch.randn(MICRO, seq, H, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run_layers(blocks, x, cfg.recompute_granularity, "uniform", 1, True)
    return sum(saved.values()) / layers


def _paper(granularity, tp=1, sp=False, **kw) -> float:
    """The paper's formula for fp32 activations on CPU, where dropout keeps a float mask (v = m = 4)."""
    return activation_bytes_per_layer(SEQ, MICRO, H, HEADS, tp=tp, sequence_parallel=sp, recompute=granularity,
                                      value_bytes=4, mask_bytes=4, **kw)


@pytest.mark.parametrize("granularity", [None, "selective", "full"])
def test_measured_activations_match_the_formula(granularity):
    measured = measured_bytes_per_layer(_block_config(0.1, granularity), ParallelState.single())
    assert measured == pytest.approx(_paper(granularity), rel=0.10)
    # Without dropout CPU attention runs a fused kernel: no s^2 terms (the plan's "fused" case).
    fused = measured_bytes_per_layer(_block_config(0.0, granularity), ParallelState.single())
    assert fused == pytest.approx(_paper(granularity, hidden_dropout=False, attention_dropout=False,
                                         attention="fused"), rel=0.10)


def test_full_recompute_keeps_one_input_per_region():
    cfg = _block_config(0.1, "full")
    for block_layers in (2, 4):
        assert measured_bytes_per_layer(cfg, ParallelState.single(), block_layers) == 4 * SEQ * MICRO * H


def _tp_activation_rank(rank, world):
    ps = ParallelState.build(tp=world)
    return {(g, sp): measured_bytes_per_layer(_block_config(0.1, g, world, sp), ps)
            for g in (None, "selective") for sp in (False, True)}


def test_measured_activations_under_tensor_and_sequence_parallelism():
    results = spawn_ranks(_tp_activation_rank, 2)
    for (granularity, sp), measured in results[0].items():
        assert results[1][(granularity, sp)] == measured  # TP ranks are symmetric
        # Under SP our column-parallel layers keep their gathered input (module docstring).
        expected = _paper(granularity, tp=2, sp=sp, sp_gathered_inputs=True)
        assert measured == pytest.approx(expected, rel=0.10), (granularity, sp)
        if not sp:
            assert measured == pytest.approx(_paper(granularity, tp=2), rel=0.10)


# Plan mode and the launcher's check ---------------------------------------------------------------


def test_plan_mode_prints_the_table_and_starts_nothing(tmp_path, env_no_launcher, capsys):
    # 2 micro-batches on 16 stages: every middle stage holds the same activations (one merged row).
    capsys.readouterr()
    code = launch_py(["model=gpt_175b", "parallel=tp8_pp16", "trainer.devices=8", "trainer.num_nodes=16",
                      "data.global_batch_size=8", "mode=plan", f"hydra.run.dir={tmp_path}"], env_no_launcher)
    out = capsys.readouterr()
    assert code == 0, out.err
    lines = out.out.splitlines()
    assert lines[0].startswith("memory plan: model=gpt_175b, 128 ranks = tp 8 x pp 16 x dp 1")
    rows = {line.split("  ")[0]: line for line in lines[2:5]}
    assert list(rows) == ["pp0 (first stage)", "pp1-14", "pp15 (last stage)"]
    assert not (tmp_path / "resolved_config.yaml").exists() and not (tmp_path / "workers").exists()


def test_plan_counts_gpt3_175b_layers_exactly():
    cfg = compose_config(["model=gpt_175b", "parallel=tp8_pp16", "trainer.devices=8", "trainer.num_nodes=16", "mode=plan"])
    derived = derive(cfg)
    h, t = 12288, 8
    # A middle stage: 6 layers; TP-sharded QKV, projection and MLP weights with the QKV and fc1
    # biases, replicated projection/fc2 biases and two LayerNorms.
    per_layer = (12 * h * h + 7 * h) // t + 6 * h
    middle = rank_memory(cfg, derived, 5)
    assert middle.params == 6 * per_layer
    assert middle.weight_bytes == middle.grad_bytes == 4 * middle.params
    assert middle.optimizer_bytes == 8 * middle.params
    first = rank_memory(cfg, derived, 0)
    assert first.params - middle.params == 51200 * h // t + 2048 * h  # vocab shard + positions


def test_distributed_optimizer_shards_optimizer_bytes():
    base = [*SMALL, "trainer.devices=4"]
    plain = plan_memory(cfg := compose_config(base), derive(cfg)).peak
    sharded = plan_memory(cfg := compose_config([*base, "optim.distributed_optimizer=true"]), derive(cfg)).peak
    assert sharded.optimizer_bytes == 2 * 4 * -(-plain.params // 4)  # 2 x ceil(N / dp) x 4 bytes
    assert sharded.weight_bytes >= plain.weight_bytes > sharded.weight_bytes - 4 * 4


def test_launch_refuses_a_run_that_cannot_fit(tmp_path):
    from megatron_hydra.launcher import run

    overrides = [*SMALL, "model.num_layers=4", "model.hidden_size=256", "model.seq_length=256"]
    peak = plan_memory(cfg := compose_config(overrides), derive(cfg)).peak.total_bytes
    cfg = compose_config([*overrides, f"trainer.device_memory_gb={0.95 * peak / 2**30}"], str(tmp_path))
    with pytest.raises(ConfigError) as err:
        run(cfg)
    message = str(err.value)
    assert "\n" not in message and "short by" in message and "trainer.device_memory_gb" in message
    assert "recompute.granularity=" in message and "GiB)" in message
    assert not (tmp_path / "resolved_config.yaml").exists()  # stopped before anything started


def test_small_cpu_runs_fit_this_machine():
    for overrides in ([], SMALL, [*SMALL, "parallel=tp2_pp2", "trainer.devices=8"]):
        cfg = compose_config(list(overrides))
        plan = plan_memory(cfg, derive(cfg))
        assert plan.fits and plan.peak.total_bytes < plan.device_bytes / 10


def test_device_memory_must_be_positive():
    cfg = compose_config([*SMALL, "trainer.device_memory_gb=0"])
    with pytest.raises(ConfigError, match="trainer.device_memory_gb=0"):
        plan_memory(cfg, derive(cfg))


# Headroom: the cross-entropy transient and, on GPUs, context, NCCL and fragmentation ------------------


class _LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """The bytes of storages created under the mode that are alive at once: now and at the peak."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = {}, 0, 0

    def _free(self, key):
        self.now -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import weakref

        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                storage = t.untyped_storage()
                if storage.data_ptr() not in self.live:
                    self.live[storage.data_ptr()] = storage.nbytes()
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._free, storage.data_ptr())
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_cross_entropy_transient_is_what_the_loss_allocates(dtype):
    """Measured: the bytes alive at the peak of the head's matmul and the loss, then of their
    backward, as the models run them (the logits handed to the loss), less what the loss keeps for
    backward (counted among the activations) and, in backward, the input's gradient
    (counted with the layers). The weight takes no gradient here: the parameters' are planned apart."""
    from megatron_hydra.parallel import host_memory
    from megatron_hydra.parallel.cross_entropy import vocab_parallel_cross_entropy
    from megatron_hydra.parallel.layers import vocab_parallel_logits
    from megatron_hydra.planning.memory import cross_entropy_transient_bytes

    host_memory.release_all()  # the logits take fresh memory, as on the first step or a GPU
    b, s, h, vocab = 2, 128, 32, 4096
    x = torch.randn(b, s, h, dtype=dtype, requires_grad=True)
    w = torch.randn(vocab, h, dtype=dtype)
    target = torch.randint(0, vocab, (b, s))
    live = _LiveBytes()
    with live:
        logits = vocab_parallel_logits(x, w, None, False, vocab)
        loss = vocab_parallel_cross_entropy(logits, target, inplace=True)
        del logits
        kept = live.now
        forward_peak, live.peak = live.peak, live.now
        loss.sum().backward()
    transient = max(forward_peak - kept, live.peak - kept - x.numel() * dtype.itemsize)
    # What the loss keeps, planned with the head's activations: v b s V (the exponentials for fp32,
    # fp64 and bf16, the fp16 logits from which backward recomputes them).
    assert kept == pytest.approx(dtype.itemsize * b * s * vocab, abs=0.02 * b * s * vocab * 4)
    # The formula: for 16-bit logits one fp32 slice (here the whole vocabulary), their gradient
    # written over them; fp32 and fp64 logits become their exponentials. Per-token vectors stay
    # under 2%.
    by_hand = b * s * vocab * {torch.float32: 0, torch.bfloat16: 4, torch.float16: 4, torch.float64: 0}[dtype]
    assert cross_entropy_transient_bytes(b, s, vocab, 1, dtype) == by_hand
    assert transient == pytest.approx(by_hand, abs=0.02 * b * s * vocab * 4)
    # Not handed over, logits stay as they were and the gradient is a new tensor.
    logits = vocab_parallel_logits(x, w, None, False, vocab)
    before = logits.detach().clone()
    vocab_parallel_cross_entropy(logits, target).sum().backward()
    assert torch.equal(logits.detach(), before)


def test_plan_puts_the_transient_on_the_last_stage():
    cfg = compose_config([*SMALL, "parallel=tp2_pp2", "trainer.devices=8", "precision=bf16"])
    plan = plan_memory(cfg, derive(cfg))
    first, last = plan.ranks
    padded_vocab = derive(cfg).transformer.padded_vocab_size  # 500 padded for tp 2
    assert last.transient_bytes == 4 * 2 * 32 * padded_vocab // 2  # one fp32 slice, here all V / t
    assert first.transient_bytes == 0
    assert first.context_bytes == first.nccl_bytes == first.fragmentation_bytes == 0  # CPU: no other headroom
    assert last.needed_bytes == last.total_bytes + last.transient_bytes


GPU_RUN = ["model=gpt_350m", "trainer=gpu", "trainer.devices=8", "parallel=tp2", "precision=bf16", "data=synthetic",
           "data.global_batch_size=64"]


def test_gpu_headroom_rows():
    from megatron_hydra.planning.memory import GIB

    cfg = compose_config(GPU_RUN)
    derived = derive(cfg)
    row = plan_memory(cfg, derived).peak
    assert row.context_bytes == GIB // 2
    # tp2 x dp4 on 8 GPUs: communicators tp, dp, model (tp x pp, here tp's ranks but its own) and world.
    assert row.nccl_bytes == 4 * 2**20 * 32 * 2 * 4
    planned = row.total_bytes + row.transient_bytes
    assert row.fragmentation_bytes == pytest.approx(planned * 0.15 / 0.85, abs=1)
    table = plan_memory(cfg, derived).table()
    for name in ("cross-entropy transient", "CUDA context", "NCCL buffers", "allocator fragmentation"):
        assert name in table


def test_gpu_fit_check_refuses_a_plan_that_fits_only_without_headroom():
    from megatron_hydra.planning.fit import check_fits
    from megatron_hydra.planning.memory import GIB

    cfg = compose_config(GPU_RUN)
    peak = plan_memory(cfg, derive(cfg)).peak
    between = (peak.total_bytes + peak.needed_bytes) / 2 / GIB  # above the tensors, below tensors + headroom
    tight = compose_config([*GPU_RUN, f"trainer.device_memory_gb={between}"])
    with pytest.raises(ConfigError) as err:
        check_fits(tight, derive(tight))
    message = str(err.value)
    assert "\n" not in message
    assert f"needs {peak.needed_bytes / GIB:.2f} GiB ({peak.total_bytes / GIB:.2f} planned + " in message
    assert f"a device has {between:.2f} GiB" in message and "short by" in message and "try " in message
    roomy = compose_config([*GPU_RUN, f"trainer.device_memory_gb={peak.needed_bytes / GIB + 0.01}"])
    check_fits(roomy, derive(roomy))


def test_moe_runs_are_planned_and_checked():
    """MoE models: mode=plan and the launcher's fit check plan them (experts per EP rank, their
    activations)."""
    from megatron_hydra.planning.fit import check_fits

    run = ["model=mixtral_8x7b", "trainer=gpu", "trainer.num_nodes=8", "parallel=tp8", "precision=bf16",
           "parallel.expert_parallel_size=8", "data.micro_batch_size=1", "data.global_batch_size=8"]
    cfg = compose_config([*run, "mode=plan"])
    plan = plan_memory(cfg, derive(cfg))
    (row,) = plan.ranks
    # Mixtral per rank: 1/8 of attention, embeddings and head (tp8), 1 of 8 experts at 1/8 (tp8 x ep8)
    t = derive(cfg).transformer
    h, layers, f = t.hidden_size, t.num_layers, t.moe.ffn_hidden_size
    experts = layers * 3 * h * f // 8
    attention = layers * (h * (t.num_attention_heads + 2 * t.num_query_groups) * t.kv_channels
                          + t.num_attention_heads * t.kv_channels * h) // 8
    rest = 2 * t.padded_vocab_size * h // 8 + layers * (2 * h + 8 * h) + h  # tables, norms, routers, final norm
    assert row.params == experts + attention + rest
    with pytest.raises(ConfigError) as err:
        small = compose_config([*run, "trainer.device_memory_gb=20"])
        check_fits(small, derive(small))
    assert "\n" not in str(err.value) and "short by" in str(err.value)


@pytest.mark.parametrize("overrides,share", [
    # (weights / dp) + what the rank's optimizer holds, split over dp when replicated: N params,
    # bf16 weights (2N), fp32 main weights (4N) and two fp32 moments (8N).
    (["optim.distributed_optimizer=false"], lambda n, dp: (2 * n + 12 * n) / dp),
    (["optim.distributed_optimizer=true"], lambda n, dp: 2 * n / dp + 12 * n / dp),
    (["parallel.data_parallel=fsdp"], lambda n, dp: (4 * n + 8 * n) / dp),  # fp32 sharded weights are the mains
])
def test_async_save_stages_the_ranks_share_of_the_checkpoint(overrides, share):
    from megatron_hydra.planning.memory import checkpoint_share_bytes

    cfg = compose_config([*SMALL, "trainer.devices=4", "precision=bf16", "checkpoint.async_save=true", *overrides])
    derived = derive(cfg)
    plan = plan_memory(cfg, derived)
    row = plan.ranks[0]
    # Bucket padding (distributed optimizer, fsdp rows) makes a shard a little larger than 1/dp.
    assert checkpoint_share_bytes(cfg, derived, row) == pytest.approx(share(row.params, 4), rel=0.02)
    assert any("checkpoint.async_save" in note for note in plan.notes)


# Context parallelism: s/cp tokens per rank, plus the exchange buffers -------------------------------

# A long-sequence Llama-like GPT (grouped-query attention, RoPE, SwiGLU) on tp 2 x pp 2 x dp 2 with
# sequence parallelism, hidden dropout on: every term of the plan is in play.
CP_RUN = [*SMALL, "model.num_layers=4", "model.hidden_size=128", "model.num_attention_heads=8",
          "model.num_query_groups=2", "model.position_embedding=rope", "model.activation=swiglu",
          "model.hidden_dropout=0.1", "model.seq_length=16384", "precision=bf16", "parallel.tensor_parallel_size=2",
          "parallel.pipeline_parallel_size=2", "parallel.sequence_parallel=true"]


def _cp_plan(cp: int, *extra: str):
    # devices = tp x pp x cp x dp: dp stays 2 whatever cp is.
    cfg = compose_config([*CP_RUN, f"trainer.devices={2 * 2 * cp * 2}", f"parallel.context_parallel_size={cp}", *extra])
    derived = derive(cfg)
    assert (derived.dp, derived.cp) == (2, cp)
    return plan_memory(cfg, derived)


def _cp_buffers(comm: str, cp: int) -> float:
    """Written out: micro-batch 2, seq 16384, 8 heads, 2 query groups, head size 16, tp 2, bf16."""
    b, s, a, g, k, t, e = 2, 16384, 8, 2, 16, 2, 2
    if comm == "p2p":  # K/V being computed on + arriving, dK/dV likewise: 4 blocks of 2 b (s/cp)(g/t) k e
        return 4 * (2 * b * (s / cp) * (g / t) * k * e)
    return 4 * b * (a / (t * cp)) * s * k * e  # q, k, v, out as [b, a/(t cp), s, k]


def _cp_layer_extra(comm: str, cp: int) -> float:
    """Per layer at cp > 1, written out (measured by the dry run, tests/test_dry_run.py): rotary
    cos and sin gathered at the rank's positions, 2 e b (s/cp) k; under a2a also attention's
    output in the head layout, e b (s/cp) (a/t) k."""
    b, s, a, k, t, e = 2, 16384, 8, 16, 2, 2
    return 2 * e * b * (s / cp) * k + (e * b * (s / cp) * (a / t) * k if comm == "a2a" else 0)


@pytest.mark.parametrize("comm", ["p2p", "a2a"])
def test_context_parallel_divides_activations_and_adds_its_buffers(comm):
    base = _cp_plan(1)
    assert all(r.cp_buffer_bytes == 0 for r in base.ranks)
    for cp in (2, 4):
        plan = _cp_plan(cp, f"parallel.cp_comm_type={comm}")
        assert len(plan.ranks) == len(base.ranks) == 2
        for pp_rank, (row, ref) in enumerate(zip(plan.ranks, base.ranks)):
            # 1F1B: stage p holds pp - p micro-batches' activations of its 2 layers at its peak.
            extra = (2 - pp_rank) * 2 * _cp_layer_extra(comm, cp)
            assert row.activation_bytes == pytest.approx(ref.activation_bytes / cp + extra, abs=1), (cp, row.position)
            assert row.cp_buffer_bytes == _cp_buffers(comm, cp)
            assert row.total_bytes == row.static_bytes + row.activation_bytes + row.cp_buffer_bytes
            # Parameters and their state are not split by cp (dp fixed, no distributed optimizer).
            for key in ("params", "weight_bytes", "grad_bytes", "main_weight_bytes", "optimizer_bytes"):
                assert getattr(row, key) == getattr(ref, key), key
            # Stage-to-stage buffers: n micro-batches x [b, s/(cp t), h] bf16, one direction per rank here.
            assert row.pipeline_buffer_bytes == 2 * 2 * (16384 // (cp * 2)) * 128 * 2
        # The loss's transient on the last stage: one fp32 slice of b (s/cp) tokens by the 256 local
        # entries (V = 512 padded for tp 2; 2^22 or fewer entries a slice: all of them here).
        tokens = 2 * (16384 // cp)
        assert plan.ranks[1].transient_bytes == 4 * tokens * min(256, 2**22 // tokens)
        table = plan.table()
        assert f"x dp 2 x cp {cp} ({comm})" in table.splitlines()[0] and "cp bufs" in table


def test_context_parallel_ranks_shard_the_distributed_optimizer():
    # Gradients are reduced over dp x cp, and the distributed optimizer shards over the same ranks.
    for cp in (1, 2, 4):
        row = _cp_plan(cp, "optim.distributed_optimizer=true").ranks[0]
        assert row.optimizer_bytes == 2 * 4 * -(-row.params // (2 * cp))  # 2 x ceil(N / (dp cp)) x 4 bytes


def test_fit_check_suggests_context_parallelism_for_long_sequences_only():
    from megatron_hydra.planning.fit import _candidates

    long = compose_config([*CP_RUN, "trainer.devices=8"])
    assert "parallel.context_parallel_size=2" in [name for name, _ in _candidates(long, derive(long))]
    short = compose_config([*SMALL, "trainer.devices=4"])
    assert not any("context_parallel" in name for name, _ in _candidates(short, derive(short)))
