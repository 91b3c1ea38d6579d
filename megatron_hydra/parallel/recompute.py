"""Activation recomputation (Korthikanti et al. 2022) that replays dropout bit for bit.

A recomputed region keeps only its inputs in forward and runs again during backward to rebuild
what its backward needs. ``torch.utils.checkpoint`` (the non-reentrant variant: it works with
``torch.autograd.grad`` and the split backward of the zero-bubble pipeline schedules) restores the
default random generators before the replay, but not the tensor-parallel stream of
``parallel.random``, whose state lives in the tracker between forks. Without it the replay of
attention dropout (and of hidden dropout under sequence parallelism) would draw new masks, and
the gradients would belong to a forward that never happened. ``checkpoint`` therefore snapshots
the tracker's states when the region runs forward and swaps the snapshot in for the replay, then
puts back whatever the tracker held, so the replay neither sees nor leaves a different stream.

The replay runs on whichever thread autograd runs the device's backward on (for an accelerator,
not the one that ran the forward), so whatever decides a region's kernels must hold on every
thread: a dispatcher registration does, a thread-local torch-function mode does not.

It lives in ``parallel/`` next to ``random``, whose state it must restore: it is model-agnostic
(any callable, any layer) and model code may import it, while nothing here knows of models.

Which layers are recomputed is decided by ``recomputed_chunks``:
- ``full`` + ``uniform``: consecutive chunks of ``num_layers`` layers, each chunk one region (one
  saved input per chunk);
- ``full`` + ``block``: each of the first ``num_layers`` layers of a stage (a pipeline chunk) is
  its own region, the remaining layers keep their activations;
- ``selective``: no whole layer; ``models.transformer.Attention`` recomputes its core attention.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from megatron_hydra.parallel.random import get_rng_tracker

def _snapshot() -> Dict[str, Dict[str, torch.Tensor]]:
    return {name: {d: s.clone() for d, s in states.items()} for name, states in get_rng_tracker().states.items()}


def _install(snapshot: Dict[str, Dict[str, torch.Tensor]]) -> None:
    tracker = get_rng_tracker()
    for name, states in snapshot.items():
        tracker.states[name] = {d: s.clone() for d, s in states.items()}


class _Replaying:
    """The tracker as it was in forward, for the duration of a replay. Re-enterable: a split
    backward (zero-bubble schedules: input grads, later weight grads) replays a region twice."""

    def __init__(self) -> None:
        self.forward_states = _snapshot()
        self.outer: List[Dict[str, Dict[str, torch.Tensor]]] = []

    def __enter__(self) -> None:
        self.outer.append(_snapshot())
        _install(self.forward_states)

    def __exit__(self, *exc) -> None:  # also when torch stops a replay early, having what it needs
        _install(self.outer.pop())


def _contexts():
    """Called by torch.utils.checkpoint when the region runs forward: the forward context, and
    the one the replay runs in (with the tracker as it is now)."""
    return nullcontext(), _Replaying()


def checkpoint(fn: Callable, *args):
    """``fn(*args)``, keeping only ``args`` for backward and replaying ``fn`` then. Outside
    autograd (no grad, evaluation) it is just ``fn(*args)``."""
    if not torch.is_grad_enabled():
        return fn(*args)
    return _torch_checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, context_fn=_contexts)


def recomputed_chunks(num_layers: int, granularity: Optional[str], method: str,
                      recompute_layers: int) -> List[Tuple[int, int, bool]]:
    """How a stage of ``num_layers`` layers runs: ``(start, end, recomputed)`` ranges, in order."""
    if granularity != "full":
        return [(0, num_layers, False)] if num_layers else []
    if method == "uniform":
        return [(i, min(i + recompute_layers, num_layers), True) for i in range(0, num_layers, recompute_layers)]
    first = min(recompute_layers, num_layers)
    return [(i, i + 1, True) for i in range(first)] + ([(first, num_layers, False)] if first < num_layers else [])


def run_layers(layers: Sequence[torch.nn.Module], x: torch.Tensor, granularity: Optional[str], method: str,
               recompute_layers: int, training: bool) -> torch.Tensor:
    """Apply ``layers`` in order, recomputing them as the config says (only when training)."""
    if not training or granularity != "full":
        for layer in layers:
            x = layer(x)
        return x
    for start, end, recomputed in recomputed_chunks(len(layers), granularity, method, recompute_layers):
        chunk = layers[start:end]
        x = checkpoint(_Sequence(chunk), x) if recomputed else _Sequence(chunk)(x)
    return x


class _Sequence:
    """Layers applied one after another (a plain callable, so no module registration)."""

    def __init__(self, layers: Sequence[torch.nn.Module]):
        self.layers = layers

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x
