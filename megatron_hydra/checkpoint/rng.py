"""Random generator states of one rank, saved so that a resumed run draws what the uninterrupted
one would have drawn (dropout masks, anything seeded).

The file holds only tensors, numbers and strings, so it is read back with
``torch.load(weights_only=True)``: loading a checkpoint never unpickles arbitrary objects.
The states belong to a rank's place in the layout; a run with another layout keeps its fresh seeds.
"""

from __future__ import annotations

import os
import random
from typing import Optional

import numpy as np

import torch

from megatron_hydra.parallel.random import get_rng_tracker


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


def load(path: str) -> None:
    restore(torch.load(path, weights_only=True))
