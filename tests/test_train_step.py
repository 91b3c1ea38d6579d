"""``training.step.TrainStep``: the one owner of a global batch's life.

The step's gradients and loss are held to plain autograd over a copy of the model (the mean of
the micro-batch losses), twice in a row (the second step must start from zeroed grads), and the
Lightning-facing classes are held to their shrunken roles: the strategy has no step machinery,
the module no "is there a Trainer" branch."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

from conftest import SMALL, compose_config


def _batch(seed: int, samples: int = 8, seq: int = 32) -> dict:
    tokens = torch.randint(0, 500, (samples, seq + 1), generator=torch.Generator().manual_seed(seed))
    mask = (torch.rand(samples, seq, generator=torch.Generator().manual_seed(seed + 1)) > 0.2).double()
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask}


def _reference(model: torch.nn.Module, batch: dict, n: int):
    """Mean loss over ``n`` micro-batches and its gradients, by plain autograd on ``model``."""
    from megatron_hydra.models.archs import masked_mean

    losses = []
    for tokens, labels, mask in zip(*(batch[k].chunk(n) for k in ("tokens", "labels", "loss_mask"))):
        losses.append(masked_mean(model(tokens, labels=labels), mask))
    loss = torch.stack(losses).mean()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_step_grads_and_loss_match_autograd_twice():
    from megatron_hydra.config import derive
    from megatron_hydra.parallel.state import ParallelState
    from megatron_hydra.training.module import LMModule
    from megatron_hydra.training.step import TrainStep
    from megatron_hydra.training.strategy import MegatronStrategy

    cfg = compose_config([*SMALL, "precision=fp64", "optim.clip_grad=0"])
    derived = derive(cfg)
    assert derived.num_microbatches == 4
    module = LMModule(cfg, derived, ParallelState.single())
    strategy = MegatronStrategy(module.ps, torch.device("cpu"), grad_bucket_size=cfg.parallel.grad_bucket_size)
    strategy.wrap_model(module)
    optimizer = module.build_optimizer(strategy.grad_buffer)
    seen = {"backward": 0}

    def backward(loss):
        seen["backward"] += 1
        loss.backward()

    def step_optimizer():  # the grads the optimizer is handed, then the real step
        seen["grads"] = {name: p.main_grad.clone() for name, p in module.model.named_parameters()}
        optimizer.step()

    step = TrainStep(module, optimizer, backward=backward, step_optimizer=step_optimizer)
    for index in range(2):
        reference = copy.deepcopy(module.model)  # the weights this step starts from
        for p in reference.parameters():
            p.grad = None
        batch = _batch(index)
        want_loss, want_grads = _reference(reference, batch, derived.num_microbatches)
        result = step(batch, index)
        assert seen["backward"] == 4 * (index + 1)
        torch.testing.assert_close(result.loss, want_loss, rtol=1e-12, atol=0)
        for name, grad in want_grads.items():
            torch.testing.assert_close(seen["grads"][name], grad, rtol=1e-9, atol=1e-12, msg=name)
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in want_grads.values()))
        torch.testing.assert_close(result.grad_norm.double(), norm, rtol=1e-9, atol=0)
        assert result.lr == pytest.approx(cfg.optim.lr * (index + 1) / cfg.optim.warmup_steps)
        assert not result.skipped
    optimizer.close()


def test_strategy_and_module_hold_no_step():
    """The step lives in ``training.step`` alone: the strategy keeps Lightning's own
    ``optimizer_step`` and no grad handling; the module does not branch on a Trainer."""
    from pytorch_lightning.strategies import ParallelStrategy

    from megatron_hydra.training import module, strategy

    cls = strategy.MegatronStrategy
    assert cls.optimizer_step is ParallelStrategy.optimizer_step
    for name in ("zero_grad", "block_backward_sync", "step_optimizer", "last_grad_norm"):
        assert name not in vars(cls), name
    assert "_trainer" not in inspect.getsource(module)
