"""Random streams for dropout under tensor parallelism (Megatron's model-parallel RNG idea).

Dropout must draw *different* masks where TP ranks hold different data and *identical* masks where
they hold the same data:

- inside a TP-sharded region (attention probabilities of this rank's heads), or on this rank's
  sequence slice under sequence parallelism, each rank needs its own stream: equal masks on
  different heads/slices would correlate them;
- in a region replicated over TP (the residual stream without sequence parallelism), every rank
  must draw the same mask, or the replicated activations, and then the replicated parameters,
  silently diverge between TP ranks.

The default generator serves the replicated case: every TP rank seeds it identically. The sharded
case swaps a second generator state, seeded per TP rank, into the default generator for the
duration of ``fork()``; dropout itself (``F.dropout``, SDPA's ``dropout_p``) takes no generator
argument, so swapping states is the only way to steer it. The swap covers the CPU generator and,
when CUDA is in use, the current device's generator, so one code path serves gloo and nccl runs.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Dict, Iterator, List

import torch
import torch.nn.functional as F

TP_RNG = "tensor-parallel"
# Megatron's offset between the replicated seed and the TP-sharded one (any constant would do, as
# long as the two streams never share a seed).
TP_SEED_OFFSET = 2718


def _device_types() -> List[str]:
    return ["cpu", "cuda"] if torch.cuda.is_available() and torch.cuda.is_initialized() else ["cpu"]


def _get_state(device_type: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device_type == "cuda" else torch.get_rng_state()


def _set_state(device_type: str, state: torch.Tensor) -> None:
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _new_state(device_type: str, seed: int) -> torch.Tensor:
    """A generator state for ``seed``, made without disturbing the default generators."""
    if device_type == "cpu":
        return torch.Generator().manual_seed(seed).get_state()
    saved = torch.cuda.get_rng_state()
    torch.cuda.manual_seed(seed)  # the current device only
    state = torch.cuda.get_rng_state()
    torch.cuda.set_rng_state(saved)
    return state


class RNGStatesTracker:
    """Named generator states, each swapped into the default generator by ``fork(name)``; what
    was drawn inside the fork advances the named state, not the default one. A device's state is
    made from the name's seed the first time a fork sees that device in use, so seeding before
    CUDA is initialised still covers CUDA."""

    def __init__(self) -> None:
        self.seeds: Dict[str, int] = {}
        self.states: Dict[str, Dict[str, torch.Tensor]] = {}

    def reset(self) -> None:
        self.seeds, self.states = {}, {}

    def add(self, name: str, seed: int) -> None:
        if name in self.seeds:
            raise ValueError(f"random state {name!r} already exists; reset() the tracker first")
        self.seeds[name] = seed
        self.states[name] = {d: _new_state(d, seed) for d in _device_types()}

    @contextmanager
    def fork(self, name: str = TP_RNG) -> Iterator[None]:
        if name not in self.seeds:
            raise RuntimeError(
                f"random state {name!r} was never seeded: call megatron_hydra.parallel.random."
                "seed_model_parallel(seed, tp_rank) before running dropout in training mode"
            )
        states = self.states[name]
        for d in _device_types():
            if d not in states:
                states[d] = _new_state(d, self.seeds[name])
        saved = {d: _get_state(d) for d in states}
        for d, state in states.items():
            _set_state(d, state)
        try:
            yield
        finally:
            for d in states:
                states[d] = _get_state(d)
                _set_state(d, saved[d])


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


def seed_model_parallel(seed: int, tp_rank: int) -> None:
    """Seed both streams of this rank: the default generator with ``seed`` (the same on every TP
    rank) and the TP-sharded state with ``seed + 2718 + tp_rank``."""
    torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(TP_RNG, seed + TP_SEED_OFFSET + tp_rank)


def stage_seed(seed: int, pp_rank: int) -> int:
    """The seed of pipeline stage ``pp_rank``: the same on every DP replica and TP rank of the
    stage, offset per stage as Megatron does (training and the dry run both seed from it)."""
    return seed + 100 * pp_rank


def tp_rng(sharded: bool):
    """The context in which to draw a random mask for a tensor that differs between TP ranks
    (``sharded``) or is replicated over them."""
    return _TRACKER.fork() if sharded else nullcontext()


def dropout(x: torch.Tensor, p: float, training: bool, sharded: bool) -> torch.Tensor:
    """``F.dropout`` drawing from the stream that matches how ``x`` is laid out over TP."""
    if not training or p == 0.0:
        return x
    with tp_rng(sharded):
        return F.dropout(x, p, True)
