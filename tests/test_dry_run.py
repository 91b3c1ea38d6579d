"""mode=dry_run: one real step of a GPU job's ranks on this CPU (fake process group, fake GPU).

The references are independent of the dry run: ``mode=plan``'s analytic bytes for weights,
grads, main weights and optimizer state; the datasets' own samples for the batch layout; and
bugs planted in the step, which must be named.
"""

from __future__ import annotations

import pytest
import torch

from megatron_hydra.config import derive
from megatron_hydra.errors import ConfigError
from megatron_hydra.models import archs
from megatron_hydra.training import dry_run as D
from megatron_hydra.training import fake_gpu
from megatron_hydra.training.fake_gpu import DryRunError
from conftest import compose_config

# Tests whose planted bug lives in this process: where a real accelerator is usable the dry run runs
# in a process of its own (fake_gpu.register), which never sees it.
in_this_process = pytest.mark.skipif(not fake_gpu.registered(),
                                     reason="a real accelerator is usable: the dry run runs in its own process")


def _cfg(*overrides):
    cfg = compose_config(["data=synthetic", "trainer=gpu", *overrides])
    return cfg, derive(cfg)


def _within_plan(result: D.RankResult, tolerance: float = 0.10) -> None:
    ratio = result.static_bytes / result.plan_static_bytes
    assert abs(ratio - 1) < tolerance, (result.position, result.state_bytes, result.plan_static_bytes)


# Full-size layers, ranks and micro-batches; fewer layers per stage than the real models (the plan
# and the step grow linearly with them, and each costs seconds of fake-tensor work): one a stage
# at pp16, whose 16 micro-batches each pass through it.
@pytest.mark.parametrize("overrides,rank", [
    (("model=gpt_175b", "model.num_layers=16", "parallel=tp8_pp16", "trainer.devices=8", "trainer.num_nodes=128",
      "data.micro_batch_size=1", "data.global_batch_size=128"), 520),  # a middle stage: 1024 ranks, dp 8
    (("model=llama3_70b", "model.num_layers=8", "parallel=tp8_pp4", "trainer.devices=8", "trainer.num_nodes=8",
      "data.micro_batch_size=1", "data.global_batch_size=8"), 63),  # the last stage, last tp rank: dp 2
])
def test_large_layouts_step_within_plan(overrides, rank):
    cfg, derived = _cfg(*overrides, "precision=bf16", "optim.distributed_optimizer=true")
    (result,) = D.dry_run(cfg, derived, [rank])
    assert result.loss_dtype == "float32"
    _within_plan(result)
    assert result.peak_bytes > result.static_bytes
    assert result.save_items > 0


def test_default_positions_cover_every_stage_and_tp_class():
    cfg, derived = _cfg("parallel=tp2_pp2", "trainer.devices=8", "data.global_batch_size=16",
                        "optim.distributed_optimizer=true", "precision=bf16")
    ranks = D.default_ranks(derived, distributed_optimizer=True)
    assert ranks == [0, 1, 2, 4, 5]  # pp0 tp0/tp1, pp0 tp0 dp1, pp1 tp0/tp1
    results = D.dry_run(cfg, derived, ranks)
    for r in results:
        _within_plan(r)


def test_fsdp_steps_on_the_fake_group_within_plan():
    # parallel.data_parallel=fsdp: FSDP2 shards, gathers and reduce-scatters on the fake group; the
    # sharded state after the step is the plan's (planning.fsdp), at dp4.
    cfg, derived = _cfg("model=gpt_125m", "model.num_layers=2", "trainer.devices=4", "data.micro_batch_size=1",
                        "data.global_batch_size=4", "precision=bf16", "parallel.data_parallel=fsdp", "mode=dry_run")
    for result in D.dry_run(cfg, derived, [0, 3]):
        _within_plan(result, tolerance=0.01)
        assert result.peak_bytes > result.static_bytes
    with pytest.raises(ConfigError, match="parallel.tensor_parallel_size=1"):
        _cfg("model=gpt_125m", "parallel=tp2", "trainer.devices=8", "parallel.data_parallel=fsdp", "mode=dry_run")


@pytest.mark.parametrize("overrides,ranks", [
    (("model=moe_tiny", "model.num_layers=2", "trainer.devices=2", "parallel.expert_parallel_size=2",
      "data.micro_batch_size=2", "data.global_batch_size=4"), [1]),
    # Mixtral's shapes at tp8 x ep8 on 64 ranks (4 of its 32 layers, to keep the test short).
    (("model=mixtral_8x7b", "model.num_layers=4", "parallel=tp8", "trainer.num_nodes=8",
      "parallel.expert_parallel_size=8", "data.micro_batch_size=1", "data.global_batch_size=8"), [0]),
])
def test_moe_steps_on_the_fake_group_within_plan(overrides, ranks):
    # The dispatch runs on fake tensors with balanced routing (parallel.expert_dispatch): the
    # all-to-alls on the fake group, the experts' matmuls on the fake GPU, no host read.
    cfg, derived = _cfg(*overrides, "precision=bf16", "optim.distributed_optimizer=true", "mode=dry_run")
    for result in D.dry_run(cfg, derived, ranks):
        _within_plan(result)
        assert result.peak_bytes > result.static_bytes
        assert result.host_syncs == []


@pytest.mark.parametrize("layout", [
    ("parallel.sequence_parallel=true", "parallel.expert_parallel_size=2"),
    # whole experts, each TP rank routing its slice of the replicated tokens; ep over tp x dp
    ("parallel.sequence_parallel=false", "parallel.expert_parallel_size=4", "parallel.expert_tensor_parallel_size=1"),
], ids=["tp2_sp_ep2", "tp2_ep4_whole_experts"])
def test_moe_activations_per_layer_match_the_plan(layout):
    """One more MoE layer's bytes at the step's peak (fake tensors, balanced routing) against the
    plan's MoE terms (planning.moe), at tp2 with a shared expert: experts split over TP (sp, ep2)
    and whole (ep4)."""
    from megatron_hydra.planning.activations import activation_bytes_per_layer
    from megatron_hydra.planning.memory import _layer_shape
    from megatron_hydra.planning.moe import layer_delta_bytes

    peaks = {}
    for layers in (1, 2):
        cfg, derived = _cfg("model=moe_tiny", "trainer.devices=4", "parallel=tp2", *layout,
                            "model.moe.shared_ffn_hidden_size=512",
                            "data.micro_batch_size=1", "data.global_batch_size=2", f"model.num_layers={layers}",
                            "precision=bf16", "model.hidden_size=512", "model.num_attention_heads=8",
                            "model.seq_length=512", "model.vocab_size=256", "mode=dry_run")
        (result,) = D.dry_run(cfg, derived, [0])
        peaks[layers] = result.peak_bytes - result.static_bytes
    measured = peaks[2] - peaks[1]
    layer = _layer_shape(cfg, derived)
    shape = {**layer, "ep": derived.ep, "whole_experts": derived.etp is not None}
    planned = activation_bytes_per_layer(**layer) + layer_delta_bytes(derived.transformer, shape)
    assert measured == pytest.approx(planned, rel=0.02)


@in_this_process
def test_planted_device_bug_is_named(monkeypatch):
    def loss_with_host_tensor(per_token_loss, loss_mask):
        weights = torch.ones(per_token_loss.shape)  # on the host, whatever the model's device
        return (per_token_loss * weights * loss_mask).sum() / loss_mask.sum()

    monkeypatch.setitem(archs.ARCHS, "gpt", archs.Arch(archs.GPTModel, loss_with_host_tensor, ("labels",)))
    cfg, derived = _cfg("trainer.devices=1")
    with pytest.raises(DryRunError, match=r"aten\.mul\.Tensor mixes devices \(cpu, fakegpu:0\) at tests/test_dry_run.py"):
        D.dry_run(cfg, derived, [0])


@in_this_process
def test_planted_dtype_bug_is_named(monkeypatch):
    from megatron_hydra.parallel import layers

    forward = layers.RowParallelLinear.forward
    monkeypatch.setattr(layers.RowParallelLinear, "forward", lambda self, x: forward(self, x.float()))
    cfg, derived = _cfg("trainer.devices=1", "precision=bf16")
    with pytest.raises(DryRunError, match=r"aten\.(add)?mm\.default mixes dtypes \(bfloat16, float32\)"):
        D.dry_run(cfg, derived, [0])


@in_this_process
def test_planted_dtype_bug_in_the_output_layer_is_named(monkeypatch):
    """The dry run takes the accelerator's LM head (``layers.StandardKernels``): checked as every matmul is."""
    from megatron_hydra.parallel import layers

    head = layers.StandardKernels.head
    monkeypatch.setattr(layers.StandardKernels, "head",
                        staticmethod(lambda rows, weight, bias, first_padded: head(rows.float(), weight, bias, first_padded)))
    cfg, derived = _cfg("trainer.devices=1", "precision=bf16")
    with pytest.raises(DryRunError, match=r"aten\.mm\.default mixes dtypes \(bfloat16, float32\)"):
        D.dry_run(cfg, derived, [0])


@in_this_process
def test_host_reads_of_device_values_are_counted():
    device = fake_gpu.register()
    with fake_gpu.fake_gpu() as check:
        x = torch.zeros(4, device=device)
        assert not bool((x > 1).any())  # unknown on a fake device: answered False, counted
        step = torch.tensor(3.0)  # a host value fake tensors still know
        assert (step + 1).item() == 4.0
    assert len(check.host_syncs) == 1 and "tests/test_dry_run.py" in check.host_syncs[0]  # the device read only


def test_dry_run_in_its_own_process_equals_in_process(monkeypatch):
    """Where this process could use a real accelerator, the ranks are simulated in a fresh process
    (forced here): the same bytes and host reads as in this one."""
    cfg, derived = _cfg("parallel=tp2", "trainer.devices=2", "precision=bf16", "model.num_layers=1")
    here = D.dry_run(cfg, derived, [1])
    monkeypatch.setattr(fake_gpu, "registered", lambda: False)
    started, spawn = [], D._in_own_process
    monkeypatch.setattr(D, "_in_own_process", lambda *args: started.append(args[2]) or spawn(*args))
    apart = D.dry_run(cfg, derived, [1])
    assert started == [[1]]
    assert [(r.state_bytes, r.peak_bytes, r.save_peak_bytes, r.host_syncs) for r in apart] == \
        [(r.state_bytes, r.peak_bytes, r.save_peak_bytes, r.host_syncs) for r in here]


def test_where_an_accelerator_is_usable_only_an_own_process_registers():
    """Registered, the stand-in becomes torch's current accelerator ahead of CUDA (NCCL's device
    binding and CUDA's autograd streams then fail: seen on an H200). So where an accelerator is
    usable (faked here), importing the dry run registers nothing and only a process of its own may."""
    import subprocess
    import sys

    code = """
import torch
torch.accelerator.is_available = lambda: True
torch.accelerator.current_accelerator = lambda check_available=False: torch.device("cuda")
from megatron_hydra.training import fake_gpu
assert fake_gpu.REAL_ACCELERATOR == "cuda" and not fake_gpu.registered()
try:
    fake_gpu.register()
    raise SystemExit("registered beside a real accelerator")
except fake_gpu.DryRunError as e:
    print(e)
assert fake_gpu.register(own_process=True).type == "fakegpu" and fake_gpu.registered()
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "can use a real accelerator (cuda)" in done.stdout


def test_errors_of_the_own_process_come_back_as_one_line():
    import os

    cfg, _ = _cfg("trainer.devices=1", "model.transformer_impl=transformer_engine")
    with pytest.raises(ConfigError, match=r"runs model.transformer_impl=local only \(got 'transformer_engine'"):
        D.run_in_own_process(D.check_runnable, cfg)  # raised there, the same error here
    with pytest.raises(DryRunError, match="ended without a result"):
        D.run_in_own_process(os.abort)  # no error to hand back: the process is gone


def test_attention_dropout_under_recompute_is_refused_before_it_starts():
    for granularity in ("full", "selective"):
        cfg, derived = _cfg("trainer.devices=1", "model.attention_dropout=0.1", f"recompute.granularity={granularity}")
        with pytest.raises(ConfigError, match=f"cannot replay attention dropout under recompute.granularity={granularity}"):
            D.dry_run(cfg, derived, [0])


def test_batch_fields_are_what_the_datasets_yield():
    from megatron_hydra.data.synthetic import SyntheticDataset

    sample = SyntheticDataset(4, seq_length=16, vocab_size=50, seed=1)[0]
    fields = D.batch_fields("gpt", 3, 16, 0)
    assert set(fields) == set(sample)
    for name, (shape, dtype) in fields.items():
        assert shape == (3, *sample[name].shape) and dtype == sample[name].dtype, name


def test_refuses_ranks_outside_the_job():
    cfg, derived = _cfg("trainer.devices=1")
    with pytest.raises(ConfigError, match=r"dry_run.ranks=\[5\] are outside the job's 1 ranks"):
        D.dry_run(cfg, derived, [5])


def test_launcher_runs_the_dry_run_before_any_gpu_check(tmp_path, capsys):
    """``mode=dry_run`` through the launcher on a machine without a GPU: no device check, no
    worker, the table on stdout."""
    from megatron_hydra.launcher import run

    cfg = compose_config(["mode=dry_run", "trainer=gpu", "trainer.devices=8", "parallel=tp2_pp2", "data=synthetic",
                          "data.global_batch_size=16", "precision=bf16", "dry_run.ranks=[0,7]"], run_dir=str(tmp_path))
    assert run(cfg) is None
    out = capsys.readouterr().out
    assert "dry run: model=gpt_tiny, 8 ranks = tp 2 x pp 2 x dp 2" in out
    assert "pp1 tp1 dp1" in out


@pytest.mark.parametrize("form", [
    (),  # GPT: LayerNorm, GELU, learned positions
    ("model.num_query_groups=2", "model.position_embedding=rope", "model.normalization=rmsnorm",
     "model.activation=swiglu", "model.add_bias_linear=false"),  # Llama
    ("parallel=tp2", "trainer.devices=2", "parallel.sequence_parallel=true", "model.position_embedding=rope"),
    # context parallelism: the ring (with rotary positions gathered per rank, GQA, tp2 + sp) and Ulysses
    ("parallel=tp2", "trainer.devices=4", "parallel.sequence_parallel=true", "model.position_embedding=rope",
     "model.num_query_groups=2", "parallel.context_parallel_size=2"),
    ("trainer.devices=2", "parallel.context_parallel_size=2", "parallel.cp_comm_type=a2a"),
    # activation recompute: the replay runs on autograd's device thread (parallel.recompute)
    ("recompute.granularity=full",),
    ("parallel=tp2", "trainer.devices=2", "parallel.sequence_parallel=true", "recompute.granularity=selective"),
    # attention within documents keeps its [b, 1, queries, keys] mask (the ring: its own queries')
    ("data=demo", "data.reset_attention_mask=true"),
    ("data=demo", "data.reset_attention_mask=true", "trainer.devices=2", "parallel.context_parallel_size=2"),
    # LoRA (planning.frozen): frozen linear layers keep no input unless an adapter reads it
    ("parallel=tp2", "trainer.devices=2", "parallel.sequence_parallel=true", "recompute.granularity=selective",
     "model.num_query_groups=2", "model.position_embedding=rope", "model.activation=swiglu", "peft=lora",
     "peft.target_modules=[qkv,fc2]"),
], ids=["gpt", "llama", "tp2_sp_rope", "cp2_tp2_sp_rope_gqa", "cp2_a2a", "full_recompute", "tp2_sp_selective_recompute",
        "document_mask", "cp2_document_mask", "lora_tp2_sp_selective"])
def test_activations_per_layer_match_the_analytic_formula(form):
    """The bytes one more layer adds to the step's peak, measured over fake tensors, against the
    plan's per-layer formula (Korthikanti et al. 2022, with the terms of this code's kernels)."""
    from megatron_hydra.planning.activations import activation_bytes_per_layer
    from megatron_hydra.planning.frozen import layer_bytes
    from megatron_hydra.planning.memory import _layer_shape

    peaks = {}
    for layers in (1, 2):
        cfg, derived = _cfg("trainer.devices=1", "data.micro_batch_size=1", "data.global_batch_size=1",
                            f"model.num_layers={layers}", "precision=bf16", "model.hidden_size=512",
                            "model.num_attention_heads=8", "model.seq_length=512", "model.vocab_size=256", *form)
        (result,) = D.dry_run(cfg, derived, [0])
        peaks[layers] = result.peak_bytes - result.static_bytes
    measured = peaks[2] - peaks[1]
    shape, recompute = _layer_shape(cfg, derived), cfg.recompute.granularity
    planned = activation_bytes_per_layer(**shape, recompute=recompute) + layer_bytes(derived.transformer, shape, recompute)
    assert measured == pytest.approx(planned, rel=0.01)
