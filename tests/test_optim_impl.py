"""optim.impl, the AdamW kernel: torch's fused AdamW equals its foreach AdamW (fp32, 1e-6 over a
few training steps); apex's FusedAdam, through a test double (tests/doubles: apex's constructor
and its AdamW-mode update in plain torch), equals torch's and keeps its per-group step count
through checkpoints; a checkpoint resumes bit for bit under every impl and loads into another
impl; ``auto``'s choice; the config and preflight errors."""

from __future__ import annotations

import warnings

import pytest
import torch

import gpu_doubles
from conftest import SMALL, compose_config
from megatron_hydra.config import derive
from megatron_hydra.errors import ConfigError

IMPLS = ("fused", "foreach", "apex")


@pytest.fixture(autouse=True)
def apex_double():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread, no waiting for a busy second core
    with gpu_doubles.installed():
        yield
    torch.set_num_threads(threads)


def _build(impl, seed=1234, distributed=False):
    from megatron_hydra.parallel.data_parallel import GradBuffer
    from megatron_hydra.parallel.state import ParallelState
    from megatron_hydra.training.module import LMModule

    # No linear biases: the key bias's gradient is zero in exact arithmetic, and AdamW turns its fp32
    # noise into steps of +-lr, so kernels that round differently would differ there by lr.
    cfg = compose_config([*SMALL, f"optim.impl={impl}", f"seed={seed}", "optim.lr=1e-2", "model.add_bias_linear=false"])
    module = LMModule(cfg, derive(cfg), ParallelState.single())
    buffer = GradBuffer(module.model.parameters(), None, cfg.parallel.grad_bucket_size, distributed=distributed)
    return module, buffer, module.build_optimizer(buffer)


def _train(built, steps):
    module, buffer, opt = built
    cfg = module.cfg
    losses = []
    for step in steps:
        gen = torch.Generator().manual_seed(100 + step)
        tokens, labels = (torch.randint(0, cfg.model.vocab_size, (4, cfg.model.seq_length), generator=gen)
                          for _ in range(2))
        buffer.zero()
        loss = module.model(tokens, labels).mean()
        loss.backward()
        buffer.finish()
        opt.step()
        losses.append(loss.item())
    return losses


def _params(built):
    return {n: p.detach().clone() for n, p in built[0].model.named_parameters()}


def _save(path, built):
    from megatron_hydra.checkpoint.sharded import save
    from megatron_hydra.parallel.state import ParallelState

    module, _, opt = built
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        save(str(path), module.model, opt, ParallelState.single(), module.derived.transformer.vocab_size,
             {"step": 2, "consumed_samples": 16, "shapes": {}}, rng_states=False)


def _load(path, built):
    from megatron_hydra.checkpoint.sharded import load
    from megatron_hydra.parallel.state import ParallelState

    module, _, opt = built
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        load(str(path), module.model, opt, ParallelState.single(), module.derived.transformer.vocab_size)


def _assert_close(ours, ref, rel):
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name], rtol=rel, atol=rel * ref[name].abs().max().item(), msg=name)


def test_auto_is_fused_on_cuda_and_the_measured_default_on_cpu():
    from megatron_hydra.parallel.optimizer import CPU_IMPL, resolve_impl

    assert resolve_impl("auto", torch.device("cuda", 0)) == "fused"
    assert resolve_impl("auto", torch.device("cpu")) == CPU_IMPL == "fused"  # benchmarks/adamw_impl.py
    assert resolve_impl("foreach", torch.device("cuda", 0)) == "foreach"
    module, _, opt = _build("auto")
    assert opt.impl == CPU_IMPL and opt.inner.defaults["fused"]
    assert _build("foreach")[2].inner.defaults["foreach"]
    assert type(_build("apex")[2].inner).__module__ == "apex.optimizers"


def _fixed_gradient_steps(built, steps):
    _, _, opt = built
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        for p in built[0].model.parameters():
            p.main_grad.copy_(torch.randn(p.shape, generator=gen) * 1e-2)
        opt.step()


def _relative_distance(ours, ref):
    """||ours - ref|| / ||ref|| over all parameters together."""
    diff = sum(((ours[n] - ref[n]).double() ** 2).sum() for n in ref)
    return (diff / sum((ref[n].double() ** 2).sum() for n in ref)).sqrt().item()


@pytest.mark.parametrize("impl", ["foreach", "apex"])
def test_kernels_equal_torch_fused_adamw(impl):
    # The same gradients at every step: the kernels differ only in rounding (apex also in where
    # weight decay enters the update, the same AdamW in exact arithmetic), weight by weight.
    fused, other = _build("fused"), _build(impl)
    for built in (fused, other):
        _fixed_gradient_steps(built, 5)
    _assert_close(_params(other), _params(fused), rel=1e-6)
    # Training on the same batches: the losses agree to 1e-6, the weights as a whole too. (Single
    # weights need not: AdamW turns the fp32 noise of a gradient that is zero in exact arithmetic,
    # such as the attention key bias's, into steps of +-lr.)
    assert _train(fused, range(4)) == pytest.approx(_train(other, range(4)), rel=1e-6)
    assert _relative_distance(_params(other), _params(fused)) < 1e-6


@pytest.mark.parametrize("impl", IMPLS)
def test_checkpoint_resumes_bit_for_bit(impl, tmp_path):
    straight = _build(impl)
    _train(straight, range(4))
    first = _build(impl)
    _train(first, range(2))
    _save(tmp_path / "ckpt", first)
    resumed = _build(impl, seed=99)  # other initial weights: everything must come from the checkpoint
    _load(tmp_path / "ckpt", resumed)
    _train(resumed, range(2, 4))
    _assert_close(_params(resumed), _params(straight), rel=0)
    ours, ref = resumed[2], straight[2]
    for pc_ours, pc_ref in zip(ours.pieces, ref.pieces):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ours.inner.state[pc_ours.main][key], ref.inner.state[pc_ref.main][key])
    if impl == "apex":  # one count per param group, restored
        assert [g["step"] for g in ours.param_groups] == [g["step"] for g in ref.param_groups] == [4, 4]


@pytest.mark.parametrize("saved_with,loaded_into", [("foreach", "fused"), ("fused", "apex"), ("apex", "foreach")])
def test_a_checkpoint_loads_into_another_impl(saved_with, loaded_into, tmp_path):
    first = _build(saved_with)
    _train(first, range(2))
    _save(tmp_path / "ckpt", first)
    resumed = _build(loaded_into, seed=99)
    _load(tmp_path / "ckpt", resumed)
    opt = resumed[2]
    for pc in opt.pieces:  # the step count, where and as this kernel keeps it
        if loaded_into == "apex":
            assert opt._group(pc)["step"] == 2
        else:
            step = opt.inner.state[pc.main]["step"]
            assert step.item() == 2 and (step.dtype == torch.float32 if loaded_into == "fused" else True)
    straight = _build(saved_with)
    assert _train(resumed, range(2, 4)) == pytest.approx(_train(straight, range(4))[2:], rel=1e-6)
    assert _relative_distance(_params(resumed), _params(straight)) < 1e-6


def test_config_and_preflight_errors(tmp_path):
    from megatron_hydra.launcher import run

    with pytest.raises(ConfigError, match="optim.impl='adam' is not supported"):
        derive(compose_config(["optim.impl=adam"]))
    with pytest.raises(ConfigError, match="optim.impl=apex .* no float64 kernel"):
        derive(compose_config(["optim.impl=apex", "precision=fp64"]))
    cfg = compose_config([*SMALL, "optim.impl=apex", "trainer.max_steps=1", "optim.warmup_steps=0"], str(tmp_path / "run"))
    with pytest.raises(ConfigError, match="optim.impl=apex needs NVIDIA apex with its CUDA extensions") as err:
        run(cfg)  # the double is importable as "apex", its CUDA extensions (amp_C) are not
    assert "\n" not in str(err.value)
