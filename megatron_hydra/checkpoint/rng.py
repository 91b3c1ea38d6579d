"""Random generator states of one rank, saved so that a resumed run draws what the uninterrupted
one would have drawn (dropout masks, anything seeded).

The file holds only tensors, numbers and strings, so it is read back with
``torch.load(weights_only=True)``: loading a checkpoint never unpickles arbitrary objects.
The states belong to a rank's place in the layout; a run with another layout keeps its fresh seeds.
A file that is not a regular file, too large, or not a state ``capture`` wrote is a one-line
``CheckpointError`` (``read``), raised before any generator is changed.
"""

from __future__ import annotations

import io
import os
import random
from typing import Optional

import numpy as np

import torch

from megatron_hydra import untrusted
from megatron_hydra.errors import CheckpointError
from megatron_hydra.parallel.random import get_rng_tracker

MAX_BYTES = 16 * untrusted.MiB  # a rank's states take a few kilobytes


def capture() -> dict:
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tracker = get_rng_tracker()
    state = {
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
        "tracker_seeds": dict(tracker.seeds),
        "tracker_states": {name: {d: s.clone() for d, s in states.items()} for name, states in tracker.states.items()},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore(state: dict) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tracker = get_rng_tracker()
    tracker.seeds = dict(state["tracker_seeds"])
    tracker.states = {name: dict(states) for name, states in state["tracker_states"].items()}


def save(path: str, state: Optional[dict] = None) -> None:
    """Write ``state`` (one that ``capture`` took earlier, e.g. before a save went to the
    background), or the states now."""
    os.makedirs(os.path.dirname(path), exist_ok=True)  # every rank writes its own file into one directory
    torch.save(capture() if state is None else state, path)


def _check_generator(state, device: str = "cpu") -> None:
    """A state ``device``'s generator takes: a CPU state is tried on a generator of its own; an
    accelerator's must have the length of this process's generator there (its ``set_rng_state``
    would refuse another only after the host generators were already set)."""
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.dim() != 1:
        raise ValueError("a generator state is not a 1-d uint8 tensor")
    kind = torch.device(device).type
    if kind == "cpu":
        torch.Generator().set_state(state)
        return
    module = getattr(torch, kind, None)
    if module is not None and getattr(module, "is_available", lambda: False)():
        expected = module.get_rng_state().numel()
        if state.numel() != expected:
            raise ValueError(f"a {kind} generator state of {state.numel()} bytes, not {expected}")


def check(state) -> None:
    """Raise ``ValueError``/``TypeError``/``KeyError`` unless ``state`` is one that ``restore``
    applies whole: each part is tried on a generator of its own, not on this process's."""
    if not isinstance(state, dict):
        raise TypeError(f"a {type(state).__name__}, not a dict")
    py, n = state["python"], state["numpy"]
    if py["gauss"] is not None and not isinstance(py["gauss"], float):
        raise TypeError("python's gauss state is not a float")
    random.Random().setstate((py["version"], tuple(py["internal"]), py["gauss"]))
    if not isinstance(n["keys"], torch.Tensor):
        raise TypeError("numpy keys are not a tensor")
    np.random.RandomState().set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                                       n["cached"]))
    _check_generator(state["torch"])
    if "cuda" in state:
        _check_generator(state["cuda"], "cuda")
    seeds, states = state["tracker_seeds"], state["tracker_states"]
    if not isinstance(seeds, dict) or not isinstance(states, dict) or set(seeds) != set(states):
        raise ValueError("the tracker's seeds and states do not match")
    for name, by_device in states.items():
        if not isinstance(seeds[name], int) or not isinstance(by_device, dict):
            raise TypeError(f"tracker state {name!r} is malformed")
        for device, gen_state in by_device.items():
            if not isinstance(device, str):
                raise TypeError(f"tracker state {name!r} names a device {device!r}")
            _check_generator(gen_state, device)


def read(path: str) -> dict:
    """The states in the file ``path``, checked; a one-line ``CheckpointError`` naming it otherwise."""
    data = untrusted.read_bytes(path, MAX_BYTES, "random-state file", CheckpointError)
    try:
        state = torch.load(io.BytesIO(data), weights_only=True)
    except Exception:  # any malformed or crafted file: one line, never a traceback (nor torch's advice)
        raise CheckpointError(f"{path}: not random states saved by megatron-hydra (not a torch file of tensors "
                              "and numbers)") from None
    try:
        check(state)
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(f"{path}: not random states saved by megatron-hydra ({type(e).__name__}: {first})") \
            from None
    return state


def load(path: str) -> None:
    restore(read(path))
