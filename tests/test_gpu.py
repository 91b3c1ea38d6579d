"""Checks only a CUDA GPU can run (``pytest -m gpu``; ``scripts/gpu_check.sh`` runs them with the
rest of the GPU acceptance). Without CUDA each is skipped, with the reason printed under ``-rs``;
their configs are checked everywhere, and each also runs as a CPU rehearsal of its mechanics.

References: the same step on the CPU (bf16 and fp16 within their tolerance), the uninterrupted
run, the run without recompute, the CPU's generated tokens, and ``mode=plan``'s bytes against what
torch's CUDA allocator reports for the same run.
"""

from __future__ import annotations

import pytest
import torch

from conftest import SMALL, assert_same_trajectory, compose_config, run_training
from megatron_hydra.config import derive

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: run scripts/gpu_check.sh on a GPU")
# Where a test runs: on the GPU, or as a rehearsal on the CPU with trainer=gpu's settings
# (trainer.accelerator=cpu), which runs the test's own mechanics (configs, logged rows, files) in
# every suite, so that a GPU's scarce minutes are not spent on a mistake of the test.
WHERE = [pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda]), "cpu_rehearsal"]


def on(where: str, overrides: list) -> list:
    return [*overrides, "trainer.accelerator=cpu"] if where == "cpu_rehearsal" else overrides


# Every step logged (trainer=gpu logs every 10th): the tests compare the rows step by step.
STEPS = ["trainer.max_steps=4", "trainer.log_every_n_steps=1", "trainer.val_check_interval=0",
         "checkpoint.save_last=false"]
PLAN_RUN = ["trainer=gpu", "trainer.devices=1", "data=synthetic", "model=gpt_125m", "precision=bf16",
            "data.micro_batch_size=4", "data.global_batch_size=8", "model.seq_length=1024", "trainer.max_steps=2",
            "trainer.log_every_n_steps=1", "optim.warmup_steps=1", "checkpoint.save_last=false",
            "trainer.enable_progress_bar=false"]
# SMALL's shapes, for the rehearsal of a run whose real shapes take minutes on a CPU.
SMALL_SHAPES = [o for o in SMALL if o.startswith("model.")]
PROFILED_RUN = [*SMALL, "trainer=gpu", "trainer.devices=1", "trainer.log_every_n_steps=1", "trainer.max_steps=3",
                "trainer.profile_steps=[1,2]", "checkpoint.save_last=false"]


def test_the_te_runs_configs_are_valid():
    """On any machine: the runs of test_gpu_te.py, which need Transformer Engine and cannot be
    rehearsed here, pass the config checks (a GPU's minutes were once spent on a config error: a
    warm-up longer than the run); the tp2 run, whose rows are compared, logs every step."""
    from test_gpu_te import FP8_RUN, MODEL, TP2_RUN

    runs = [MODEL, [*FP8_RUN, "precision=fp8"], [*FP8_RUN, "precision=fp8", "precision.fp8.recipe=current"],
            [*FP8_RUN, "precision=bf16"], TP2_RUN, [*TP2_RUN, "model.transformer_impl=transformer_engine"]]
    for overrides in runs:
        derive(compose_config(overrides))
    assert compose_config(TP2_RUN).trainer.log_every_n_steps == 1


# The Llama form (RoPE, RMSNorm, SwiGLU, grouped-query attention) takes other GPU kernels than GPT's.
LLAMA = ["model.position_embedding=rope", "model.normalization=rmsnorm", "model.activation=swiglu",
         "model.num_query_groups=2", "model.add_bias_linear=false", "model.tie_embeddings=false"]
FORMS = {"gpt": [], "llama": LLAMA}


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_step_on_cuda_follows_the_cpu_step(tmp_path, precision, form, where):
    """Same config, same seed: the GPU's 16-bit losses follow the CPU's to 16-bit precision (the
    kernels differ in accumulation order, not in what they compute); fp16 also unscales and checks
    its gradients with the CUDA kernel."""
    common = [*SMALL, *FORMS[form], *STEPS, f"precision={precision}", "trainer.devices=1"]
    gpu = run_training(on(where, ["trainer=gpu", *common]), tmp_path / "gpu")
    cpu = run_training(["trainer=cpu", *common], tmp_path / "cpu")
    assert len(gpu) == len(cpu) == 4
    assert gpu[-1]["loss"] < gpu[0]["loss"] - 0.1  # it learns (4 steps: 0.16 to 0.25 on the CPU)
    assert_same_trajectory(gpu, cpu, rel=2e-2, keys=("loss",))
    assert_same_trajectory(gpu, cpu, rel=5e-2, keys=("grad_norm",))  # NaN where a step was skipped
    if precision == "fp16":  # no overflow at these scales: every step taken, the scale untouched
        assert [(r["skipped_steps"], r["loss_scale"]) for r in gpu + cpu] == [(0.0, 65536.0)] * 8


@pytest.mark.parametrize("where", WHERE)
def test_plan_predicts_the_allocator_peak(tmp_path, where):
    """``mode=plan``'s weights + grads + main weights + optimizer + activations for a single GPU
    run, against the allocator's peak over two steps (the CUDA context, NCCL and the allocator's
    caching are outside both). The run logs each step's peak (``peak_memory_gib``, the allocator's
    ``max_memory_allocated`` since the previous logged step, which then starts a new window): the
    largest is the run's."""
    from megatron_hydra.planning.memory import rank_memory

    overrides = on(where, PLAN_RUN if where == "cuda" else [*PLAN_RUN, *SMALL_SHAPES])
    rows = run_training(overrides, tmp_path)
    assert len(rows) == 2
    measured = max(r["peak_memory_gib"] for r in rows) * 2**30
    cfg = compose_config(overrides)
    planned = rank_memory(cfg, derive(cfg), 0)
    planned_bytes = planned.static_bytes + planned.activation_bytes
    print(f"allocator peak {measured / 2**30:.2f} GiB, plan {planned_bytes / 2**30:.2f} GiB")
    if where == "cuda":  # a CPU's peak is the process's resident memory, the interpreter's included
        assert measured == pytest.approx(planned_bytes, rel=0.10)


@pytest.mark.parametrize("where", WHERE)
def test_peak_memory_and_profiler_on_cuda(tmp_path, where):
    """``peak_memory_gib`` is the allocator's peak (at least 16 bytes per parameter: weights,
    grads, main weights and AdamW moments; at most the device), and the profiled steps' trace
    holds CUDA kernels."""
    import json

    rows = run_training(on(where, PROFILED_RUN), tmp_path)
    assert len(rows) == 3
    events = json.loads((tmp_path / "profile" / "rank0.json").read_text())["traceEvents"]
    assert events
    if where == "cuda":
        h, layers = 64, 2  # SMALL's GPT, counted as in test_observability.py
        params = 512 * h + 32 * h + layers * (12 * h * h + 13 * h) + 2 * h
        device_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
        assert all(16 * params / 2**30 < r["peak_memory_gib"] < device_gib for r in rows)
        assert any(e.get("cat") == "kernel" for e in events)


# fp32 (TF32 off) with dropout: the GPU's dropout masks come from the CUDA generator and the
# tensor-parallel tracker's CUDA states, which a resume and a recompute replay must restore. Planted
# on a CPU (no random states restored on resume; a replay that does not preserve them), the wrong
# masks moved the loss by 3e-4 or more and the grad norm by 6e-3 or more at every step.
# The first compared step is held to 1e-5 (CUDA's fp32 attention backward is not deterministic, at
# about 1e-7); the later ones to 1e-4, as AdamW carries that noise on (about 2e-5 in a few steps).
DROPOUT_RUN = [*SMALL, "trainer=gpu", "trainer.devices=1", "precision=fp32", "model.hidden_dropout=0.1",
               "model.attention_dropout=0.1", "trainer.max_steps=4", "trainer.log_every_n_steps=1",
               "trainer.val_check_interval=0"]
SAVING_RUN = [*DROPOUT_RUN, "checkpoint.every_n_steps=2", "checkpoint.keep_last=0"]  # async saves (default)


def _same_steps(rows, ref):
    assert_same_trajectory(rows[:1], ref[:1], rel=1e-5)
    assert_same_trajectory(rows, ref, rel=1e-4)


@pytest.mark.parametrize("where", WHERE)
def test_resume_on_cuda_continues_the_run(tmp_path, where):
    """Saved asynchronously from the GPU (pinned host copies) at step 2, resumed from there: the
    resumed steps are the uninterrupted run's, dropout masks included."""
    import shutil

    full = run_training(on(where, SAVING_RUN), tmp_path / "full")
    assert len(full) == 4
    name = "checkpoints/step_0000002"
    shutil.copytree(tmp_path / "full" / name, tmp_path / "resumed" / name)
    resumed = run_training(on(where, [*SAVING_RUN, "checkpoint.resume=auto"]), tmp_path / "resumed")
    _same_steps(resumed, full[2:])


@pytest.mark.parametrize("where", WHERE)
def test_recompute_on_cuda_keeps_the_run(tmp_path, where):
    """Full recompute replays each layer's forward on the GPU under the forward's random state:
    the same losses and grad norms as without recompute."""
    plain = run_training(on(where, [*DROPOUT_RUN, "checkpoint.save_last=false"]), tmp_path / "plain")
    assert len(plain) == 4
    replayed = run_training(on(where, [*DROPOUT_RUN, "checkpoint.save_last=false", "recompute.granularity=full"]),
                            tmp_path / "full")
    _same_steps(replayed, plain)


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("variant", [("learned", "gelu", 4), ("rope", "swiglu", 2)], ids=["gpt2_style", "llama_gqa"])
def test_generation_on_cuda_gives_the_cpu_tokens(variant, where):
    """Greedy decoding with the KV cache on the GPU gives the CPU's tokens (float64, large logits:
    the kernels' rounding cannot change an argmax); sampling draws from a generator on the GPU."""
    from test_generate import _greedy, _model

    from megatron_hydra.generate import SamplingConfig, generate

    device = "cuda" if where == "cuda" else "cpu"
    _, model = _model(*variant)
    prompt = [5, 17, 99, 3, 42]
    on_cpu = generate(model, prompt, 24, _greedy())
    model.to(device)
    assert generate(model, prompt, 24, _greedy(), use_cache=True) == on_cpu
    sampling = SamplingConfig(temperature=0.8, top_k=50, top_p=0.95)

    def sample(seed):
        return generate(model, prompt, 16, sampling, generator=torch.Generator(device=device).manual_seed(seed))

    first = sample(0)
    assert len(first) == 16 and all(0 <= t < model.cfg.vocab_size for t in first)
    assert sample(0) == first and sample(1) != first  # drawn from the seeded generator on the device
