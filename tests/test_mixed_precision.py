"""bf16 and fp16 training: fp32 main weights and grads, loss scaling, overflow skipping, resume."""

from __future__ import annotations

import shutil

import pytest
import torch

from conftest import SMALL, assert_same_trajectory, compose_config, run_training, spawn_ranks

STEPS = 10
# No final checkpoint where nothing reads it.
NO_FINAL_SAVE = ["checkpoint.save_last=false"]
VALIDATE = ["trainer.val_check_interval=5", "trainer.limit_val_batches=2"]


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    return run_training([*SMALL, *NO_FINAL_SAVE, f"trainer.max_steps={STEPS}", *VALIDATE],
                        tmp_path_factory.mktemp("fp32"))


@pytest.mark.parametrize("precision,layout", [("bf16", []), ("fp16", []), ("bf16", ["trainer.devices=2", "parallel=tp2"]),
                                              ("bf16", ["trainer.devices=2", "optim.distributed_optimizer=true"]),
                                              ("fp16", ["trainer.devices=2", "parallel=pp2"])])
def test_tracks_fp32_loss(fp32, precision, layout, tmp_path):
    # Tolerance: bf16 keeps 8 significant bits, so every weight, activation and logit carries a
    # relative rounding error of up to 2^-9 ~ 2e-3. Losses are means over 256 tokens of ~6-nat
    # cross entropies, which average these errors down, and the fp32 main weights keep the
    # updates themselves exact; measured here the gap stays below 3e-4 relative over 20 steps
    # (fp16, 11 bits: below 5e-5), so over the 10 run here too. 2e-3 (one bf16 ulp) leaves room
    # for other shapes and seeds, while a real bug (a lost update, a 16-bit accumulation, an
    # unscaled gradient) moves the loss by far more: a skipped step alone changed the step-20
    # loss by ~1e-2, and over these 10 steps the fp32 loss falls by ~7e-3 relative per step
    # (6.23 to 5.79), so a lost update is several tolerances away from step 5 on.
    rows = run_training([*SMALL, *NO_FINAL_SAVE, f"trainer.max_steps={STEPS}", *VALIDATE,
                         f"precision={precision}", *layout], tmp_path)
    train = [r for r in rows if "loss" in r]
    ref_train = [r for r in fp32 if "loss" in r]
    assert len(train) == STEPS
    assert_same_trajectory(train, ref_train, rel=2e-3, keys=("loss",))
    # Validation too: the loss scale must not leak into it (nor into the pipeline's loss sum).
    val, ref_val = [r["val_loss"] for r in rows if "val_loss" in r], [r["val_loss"] for r in fp32 if "val_loss" in r]
    assert len(val) == len(ref_val) == 2 and val == pytest.approx(ref_val, rel=2e-3)
    rows = train
    if precision == "fp16":
        assert rows[-1]["loss_scale"] == 65536.0 and rows[-1]["skipped_steps"] == 0


def test_loss_scaler_follows_its_rules():
    from megatron_hydra.training.precision import DynamicLossScaler

    s = DynamicLossScaler(initial_scale=1024, min_scale=256, window=3, hysteresis=2)
    s.update(True)
    assert s.scale == 1024  # first overflow only uses up hysteresis
    s.update(True)
    assert s.scale == 512 and s.skipped_steps == 2
    s.update(True)
    assert s.scale == 256
    s.update(True)
    assert s.scale == 256  # never below the minimum
    for _ in range(3):
        s.update(False)
    assert s.scale == 512 and s.overflows_left == 2  # a clean window doubles it and resets hysteresis
    clone = DynamicLossScaler(1, 1, 1, 1)
    clone.load_state_dict(s.state_dict())
    assert clone.state_dict() == s.state_dict()


def _overflow_rank(rank, world, bad_rank):
    from megatron_hydra.config import derive
    from megatron_hydra.parallel.data_parallel import GradBuffer
    from megatron_hydra.parallel.state import ParallelState
    from megatron_hydra.training.module import LMModule

    torch.set_num_threads(1)
    cfg = compose_config([*SMALL, f"trainer.devices={world}", "parallel=tp2", "precision=fp16", "precision.hysteresis=1"])
    derived = derive(cfg)
    ps = ParallelState.build(tp=derived.tp, dp=derived.dp)
    module = LMModule(cfg, derived, ps)
    buffer = GradBuffer(module.model.parameters(), ps.dp_cp_group, cfg.parallel.grad_bucket_size)
    opt = module.build_optimizer(buffer)
    tokens = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(ps.dp_rank))
    params = list(module.model.parameters())
    history = []
    for step in range(2):
        buffer.zero()
        loss = module.microbatch_loss({"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(2, 32)})
        (loss * module.loss_scale).backward()
        buffer.finish()
        if step == 0 and rank == bad_rank:  # one rank's gradient overflows
            params[3].main_grad.view(-1)[0] = float("inf")
        before = [p.detach().clone() for p in params]
        opt.step()
        changed = any(not torch.equal(b, p) for b, p in zip(before, params))
        history.append((changed, module.loss_scaler.scale, module.loss_scaler.skipped_steps))
    return history


def test_fp16_overflow_skips_the_step_on_every_rank():
    # tp2 x dp2: the inf on rank 3 must stop the step on its TP peer and on the other replica too.
    results = spawn_ranks(_overflow_rank, 4, 3)
    for rank, history in results.items():
        (changed0, scale0, skipped0), (changed1, scale1, skipped1) = history
        assert not changed0 and scale0 == 32768.0 and skipped0 == 1, rank  # skipped, scale halved
        assert changed1 and scale1 == 32768.0 and skipped1 == 1, rank  # and training continues


BF16_3_STEPS = [*SMALL, "precision=bf16", "trainer.max_steps=3"]


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """The checkpoint of a 3-step single-process bf16 run (tests read it, or copy it first)."""
    ckpt = tmp_path_factory.mktemp("bf16") / "ckpt"
    run_training([*BF16_3_STEPS, f"checkpoint.dir={ckpt}"], ckpt.parent / "run")
    return ckpt


@pytest.mark.parametrize("layout", [[], ["trainer.devices=2", "optim.distributed_optimizer=true"]],
                         ids=["plain", "dp2_distributed_optimizer"])
def test_bf16_resume_restores_fp32_main_weights(bf16_checkpoint, layout, tmp_path):
    # The model holds bf16 weights; Adam's fp32 main weights carry the bits the model lacks (under
    # ZeRO-1 they and the Adam state live in shards: saved gathered, loaded back into each rank's
    # pieces). A resumed run equals the uninterrupted one bit for bit only if the checkpoint kept them.
    common = [*SMALL, "precision=bf16", "trainer.max_steps=6", *layout]
    whole = run_training([*common, *NO_FINAL_SAVE], tmp_path / "whole")
    ckpt = tmp_path / "ckpt"
    if layout:
        run_training([*common, "trainer.max_steps=3", f"checkpoint.dir={ckpt}"], tmp_path / "first")
    else:  # the same run as the shared one: [*BF16_3_STEPS, checkpoint.dir]
        shutil.copytree(bf16_checkpoint, ckpt)
    resumed = run_training([*common, *NO_FINAL_SAVE, f"checkpoint.dir={ckpt}"], tmp_path / "second")
    assert [int(r["step"]) for r in resumed] == [3, 4, 5]
    assert_same_trajectory(resumed, whole[3:], rel=0, keys=("loss",))


def test_bf16_checkpoint_keeps_fp32_main_weights_that_an_fp32_model_loads(bf16_checkpoint, tmp_path):
    # Read back with torch's own DCP converter (independent of our loader): the checkpoint holds
    # the bf16 model and its fp32 main weights, the former the rounding of the latter; an fp32
    # model loading it gets the fp32 main weights, not the rounded copy.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from megatron_hydra.checkpoint import sharded
    from megatron_hydra.config import derive
    from megatron_hydra.models.gpt import GPTModel
    from megatron_hydra.parallel.state import ParallelState

    step_dir = bf16_checkpoint / "step_0000003"
    dcp_to_torch_save(str(step_dir), str(tmp_path / "whole.pt"))
    saved = torch.load(tmp_path / "whole.pt", weights_only=True)
    names = [k[len("main/"):] for k in saved if k.startswith("main/")]
    assert names and all(saved[f"model/{n}"].dtype == torch.bfloat16 for n in names)
    assert all(saved[f"main/{n}"].dtype == torch.float32 for n in names)
    assert all(torch.equal(saved[f"main/{n}"].to(torch.bfloat16), saved[f"model/{n}"]) for n in names)
    assert any(not torch.equal(saved[f"main/{n}"], saved[f"model/{n}"].float()) for n in names)

    derived = derive(compose_config(SMALL))
    model = GPTModel(derived.transformer, ParallelState.single())
    sharded.load(str(step_dir), model, None, ParallelState.single(), derived.transformer.vocab_size, load_optimizer=False)
    for name, p in model.named_parameters():
        expected = saved[f"main/{name}"]
        assert torch.equal(p.detach()[:expected.shape[0]], expected), name


def test_bf16_run_takes_its_main_weights_exactly_from_an_fp32_checkpoint(tmp_path):
    # A checkpoint without main/ tensors (saved by an fp32 run, or by FSDP, whose sharded weights
    # are the fp32 main weights) holds fp32 weights: a bf16 run's fp32 main weights must be those,
    # not the bf16 rounding its model holds.
    from megatron_hydra.checkpoint import sharded
    from megatron_hydra.config import derive
    from megatron_hydra.parallel.data_parallel import GradBuffer
    from megatron_hydra.parallel.state import ParallelState
    from megatron_hydra.training.module import LMModule

    ps = ParallelState.single()

    def build(precision):
        cfg = compose_config([*SMALL, f"precision={precision}"])
        derived = derive(cfg)
        module = LMModule(cfg, derived, ps)
        buffer = GradBuffer(module.model.parameters(), None, cfg.parallel.grad_bucket_size)
        return module, buffer, module.build_optimizer(buffer), derived.transformer.vocab_size

    module, buffer, opt, vocab = build("fp32")
    for name, p in module.model.named_parameters():
        p.main_grad.normal_(generator=torch.Generator().manual_seed(p.numel()))
        if name == "embedding.weight":
            p.main_grad[vocab:] = 0  # no gradient reaches the padding rows
    opt.step()  # weights no bf16 value equals
    sharded.save(str(tmp_path / "step_0000001"), module.model, opt, ps, vocab, {"step": 1, "consumed_samples": 8})
    saved = {n: p.detach().clone() for n, p in module.model.named_parameters()}

    module16, _, opt16, _ = build("bf16")
    sharded.load(str(tmp_path / "step_0000001"), module16.model, opt16, ps, vocab)
    names = {p: n for n, p in module16.model.named_parameters()}
    assert opt16.separate
    for pc in opt16.pieces:
        ref = saved[names[pc.param]].reshape(-1)[pc.lo:pc.hi]
        assert torch.equal(pc.main.detach().reshape(-1), ref), names[pc.param]
        assert torch.equal(pc.param.detach().reshape(-1)[pc.lo:pc.hi], ref.to(torch.bfloat16))
