"""GPU-only checks of the Transformer Engine, FP8, fused-AdamW and apex switches (docs/gpu.md),
what the CPU tests (test_te_mapping.py, test_optim_impl.py: a test double in place of TE and apex)
cannot prove: the real TE modules' parameter names and shapes, their numerics against the local
layers, FP8 training, and the CUDA kernels of fused AdamW and apex's FusedAdam.

    python -m pytest -m gpu tests/test_gpu_te.py -rs    # NGC PyTorch image, one GPU (two for tp2)

Each test skips, with the reason, where CUDA, Transformer Engine, FP8 or apex is absent.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from conftest import compose_config, run_training
from megatron_hydra.config import derive

pytestmark = pytest.mark.gpu

# Shapes TE's FP8 GEMMs take (dims divisible by 16), small enough for seconds per test.
SHAPE = ["model.num_layers=2", "model.hidden_size=256", "model.num_attention_heads=8", "model.seq_length=128",
         "data.micro_batch_size=4", "data.global_batch_size=8"]
MODEL = [*SHAPE, "model.vocab_size=1000", "data=synthetic"]
LLAMA = ["model.position_embedding=rope", "model.normalization=rmsnorm", "model.activation=swiglu",
         "model.num_query_groups=2", "model.add_bias_linear=false", "model.tie_embeddings=false"]


def need(*modules: str, gpus: int = 1, fp8: bool = False) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs, {torch.cuda.device_count()} visible")
    for module in modules:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")
    if fp8:
        try:
            from transformer_engine.pytorch.fp8 import check_fp8_support
        except ImportError:
            from transformer_engine.pytorch import is_fp8_available

            def check_fp8_support():
                return is_fp8_available(return_reason=True)
        available, reason = check_fp8_support()
        if not available:
            pytest.skip(f"no FP8 on this GPU: {reason}")


def _models(overrides, dtype):
    from megatron_hydra.models.gpt import GPTModel
    from megatron_hydra.models.init import init_weights
    from megatron_hydra.parallel.state import ParallelState

    tcfg = dataclasses.replace(derive(compose_config([*MODEL, *overrides])).transformer, params_dtype=dtype)
    ps = ParallelState.single()
    out = []
    for impl in ("local", "transformer_engine"):
        model = GPTModel(dataclasses.replace(tcfg, transformer_impl=impl), ps, device="cuda")
        init_weights(model, tcfg, 1234, 0, 1)
        out.append(model)
    return tcfg, out


@pytest.mark.parametrize("variant", ["gpt", "llama"])
def test_real_te_parameters_are_the_ones_the_map_names(variant):
    need("transformer_engine")
    from megatron_hydra.models.backends import logical_parameters

    tcfg, (local, te_model) = _models(LLAMA if variant == "llama" else [], torch.bfloat16)
    ours = {lp.name: lp.tensor.shape for lp in logical_parameters(local)}
    theirs = {lp.name: lp.tensor.shape for lp in logical_parameters(te_model)}
    assert theirs == ours
    assert all(hasattr(p, "logical") for n, p in te_model.named_parameters() if n.startswith("layers."))


@pytest.mark.parametrize("variant", ["gpt", "llama"])
def test_te_logits_and_grads_match_local_bf16(variant):
    need("transformer_engine")
    tcfg, (local, te_model) = _models(LLAMA if variant == "llama" else [], torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens, labels = (torch.randint(0, tcfg.vocab_size, (4, tcfg.seq_length), device="cuda", generator=gen)
                      for _ in range(2))
    v = tcfg.vocab_size
    a, b = local(tokens)[..., :v].float(), te_model(tokens)[..., :v].float()
    assert (a - b).abs().max() <= 3e-2 * a.abs().max()  # bf16: different kernels, different rounding
    from megatron_hydra.models.backends import logical_parameters

    for model in (local, te_model):
        model(tokens, labels).float().mean().backward()
    grads = []
    for model in (local, te_model):
        grads.append({lp.name: (lp.param.grad if lp.rows is None else lp.param.grad[lp.rows]).float()
                      for lp in logical_parameters(model)})
    for name, g in grads[0].items():
        cos = torch.nn.functional.cosine_similarity(g.flatten(), grads[1][name].flatten(), dim=0)
        assert cos > 0.99, f"{name}: cosine {cos:.4f}"


# The runs below (test_gpu.py checks their configs on any machine).
FP8_RUN = [*SHAPE, *LLAMA, "data=demo", "trainer=gpu", "trainer.devices=1", "trainer.max_steps=30",
           "optim.warmup_steps=5", "model.transformer_impl=transformer_engine", "trainer.generate_sample_tokens=0",
           "trainer.enable_progress_bar=false"]
TP2_RUN = [*MODEL, *LLAMA, "trainer=gpu", "trainer.devices=2", "parallel=tp2", "parallel.sequence_parallel=true",
           "precision=bf16", "trainer.max_steps=10", "trainer.log_every_n_steps=1", "optim.warmup_steps=2",
           "trainer.enable_progress_bar=false"]


def test_fp8_trains_and_its_loss_falls(tmp_path):
    need("transformer_engine", fp8=True)
    common = FP8_RUN
    for recipe in ("delayed", "current"):
        rows = run_training([*common, "precision=fp8", f"precision.fp8.recipe={recipe}"], tmp_path / recipe)
        losses = [r["loss"] for r in rows]
        assert all(map(torch.isfinite, torch.tensor(losses)))
        assert losses[-1] < losses[0] - 1.0, losses
    bf16 = [r["loss"] for r in run_training([*common, "precision=bf16"], tmp_path / "bf16")]
    assert abs(losses[-1] - bf16[-1]) < 0.1 * bf16[-1]  # FP8 follows the bf16 run


def test_te_tp2_follows_local_tp2(tmp_path):
    need("transformer_engine", gpus=2)
    common = TP2_RUN
    local = run_training(common, tmp_path / "local")
    te_rows = run_training([*common, "model.transformer_impl=transformer_engine"], tmp_path / "te")
    assert len(local) == len(te_rows) == 10
    for a, b in zip(local, te_rows):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-2)


def _optimizer_on_cuda(impl, seed=1234):
    from megatron_hydra.models.gpt import GPTModel
    from megatron_hydra.models.init import init_weights
    from megatron_hydra.parallel.data_parallel import GradBuffer
    from megatron_hydra.parallel.optimizer import MegatronOptimizer
    from megatron_hydra.parallel.state import ParallelState

    tcfg = derive(compose_config(MODEL)).transformer
    model = GPTModel(tcfg, ParallelState.single(), device="cuda")
    init_weights(model, tcfg, seed, 0, 1)
    buffer = GradBuffer(model.parameters(), None, 10**8)
    opt = MegatronOptimizer(model, buffer, ParallelState.single(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1, clip_grad=1.0, impl=impl)
    return tcfg, model, opt


def _steps(model, opt, steps):
    from megatron_hydra.models.init import VOCAB_TABLES

    for step in steps:
        gen = torch.Generator(device="cuda").manual_seed(step)
        for name, p in model.named_parameters():
            p.main_grad.copy_(torch.randn(p.shape, device="cuda", generator=gen) * 1e-2)
            if name in VOCAB_TABLES:  # no gradient reaches the padding rows
                p.main_grad[model.cfg.vocab_size:] = 0
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("impl", ["fused", "apex"])
def test_cuda_adamw_kernels_equal_foreach(impl):
    need(*(("apex", "amp_C") if impl == "apex" else ()))
    ref = _steps(*_optimizer_on_cuda("foreach")[1:], range(5))
    _, model, opt = _optimizer_on_cuda(impl)
    ours = _steps(model, opt, range(5))
    if impl == "fused":
        assert opt.inner.state[opt.pieces[0].main]["step"].device.type == "cuda"
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name], rtol=1e-6, atol=1e-6 * ref[name].abs().max().item(), msg=name)


@pytest.mark.parametrize("impl", ["fused", "apex"])
def test_cuda_adamw_checkpoints_resume_exactly(impl, tmp_path):
    need(*(("apex", "amp_C") if impl == "apex" else ()))
    from megatron_hydra.checkpoint.sharded import load, save
    from megatron_hydra.parallel.state import ParallelState

    ref = _steps(*_optimizer_on_cuda(impl)[1:], range(4))
    tcfg, model, opt = _optimizer_on_cuda(impl)
    _steps(model, opt, range(2))
    save(str(tmp_path / "ckpt"), model, opt, ParallelState.single(), tcfg.vocab_size,
         {"step": 2, "consumed_samples": 16, "shapes": {}}, rng_states=False)
    _, model, opt = _optimizer_on_cuda(impl, seed=99)
    load(str(tmp_path / "ckpt"), model, opt, ParallelState.single(), tcfg.vocab_size)
    ours = _steps(model, opt, range(2, 4))
    for name in ref:
        assert torch.equal(ours[name], ref[name]), name
