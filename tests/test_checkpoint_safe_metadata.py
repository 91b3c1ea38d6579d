"""Loading a checkpoint never runs code from its files: DCP's pickled metadata goes through an
allowlist, and tensor data through torch.load(weights_only=True)."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_hydra.checkpoint.safe_reader import SafeReader, read_metadata
from megatron_hydra.errors import CheckpointError


def test_real_dcp_metadata_loads_through_the_allowlist(tmp_path):
    state = {"model/w": torch.randn(4, 3, dtype=torch.float64), "optim/w/step": torch.tensor(3.0)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path)))
    meta = read_metadata(str(tmp_path)).state_dict_metadata
    assert list(meta["model/w"].size) == [4, 3]
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(target, storage_reader=SafeReader(str(tmp_path)))
    for key in state:
        assert torch.equal(target[key], state[key])


class _Exploit:
    def __init__(self, canary):
        self.canary = canary

    def __reduce__(self):
        return (os.system, (f"touch {self.canary}",))


def test_crafted_metadata_is_refused_without_running_it(tmp_path):
    canary = tmp_path / "pwned"
    with open(tmp_path / ".metadata", "wb") as f:
        pickle.dump(_Exploit(canary), f)
    with pytest.raises(CheckpointError, match=r"\.metadata: refused to load .*system"):
        read_metadata(str(tmp_path))
    assert not canary.exists()
