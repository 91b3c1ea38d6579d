"""Loading a checkpoint never runs code from its files: DCP's pickled metadata goes through an
exact allowlist of (module, name) pairs, byte entries are refused, storage files stay inside the
checkpoint directory, and tensor data goes through torch.load(weights_only=True)."""

from __future__ import annotations

import os
import pickle
import struct

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_hydra.checkpoint.safe_reader import ALLOWED_GLOBALS, read_metadata, safe_load
from megatron_hydra.errors import CheckpointError


def _save(state, path):
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)


def test_real_dcp_metadata_loads_through_the_allowlist(tmp_path):
    state = {"model/w": torch.randn(4, 3, dtype=torch.float64), "optim/w/step": torch.tensor(3.0),
             "model/b": torch.ones(2, dtype=torch.bfloat16), "i": torch.arange(3)}
    _save(state, tmp_path)
    meta = read_metadata(str(tmp_path)).state_dict_metadata
    assert list(meta["model/w"].size) == [4, 3]
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    safe_load(target, str(tmp_path))
    for key in state:
        assert torch.equal(target[key], state[key])


def _global(protocol: int, module: str, name: str) -> bytes:
    """The opcodes that push ``module.name`` in the given pickle protocol."""
    if protocol >= 4:
        def s(x):
            b = x.encode()
            return b"\x8c" + bytes([len(b)]) + b  # SHORT_BINUNICODE
        return s(module) + s(name) + b"\x93"  # STACK_GLOBAL
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"  # GLOBAL


def _call(protocol: int, module: str, name: str, arg: str) -> bytes:
    """A pickle that calls ``module.name(arg)`` when loaded, as a crafted file would."""
    a = arg.encode()
    head = b"\x80" + bytes([protocol])
    if protocol >= 4:
        head += b"\x95" + struct.pack("<Q", 0)  # FRAME (length unchecked by the reader)
    return head + _global(protocol, module, name) + b"X" + struct.pack("<I", len(a)) + a + b"\x85R."


# Targets reachable through each allowed module: a dotted name resolved through what the module
# imports (pickle protocol >= 4 follows dots), and plain names the module holds but are not listed.
_ATTACKS = [
    (module, name)
    for module in ALLOWED_GLOBALS
    for name in ("os.system", "sys.modules.os.system", "system", "eval", "getattr", "load")
] + [("os", "system"), ("builtins", "eval"), ("subprocess", "getoutput"),
     ("torch", "load"), ("torch.serialization", "load"), ("torch.distributed.checkpoint.metadata", "os.system"),
     ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata")]


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_crafted_metadata_through_every_allowed_module_is_refused(tmp_path, protocol):
    canary = tmp_path / "pwned"
    for module, name in _ATTACKS:
        with open(tmp_path / ".metadata", "wb") as f:
            f.write(_call(protocol, module, name, f"touch {canary}"))
        with pytest.raises(CheckpointError, match=r"\.metadata: refused to load"):
            read_metadata(str(tmp_path))
        assert not canary.exists(), (module, name)


def test_the_crafted_pickle_would_run_without_the_allowlist(tmp_path):
    """The attack helper is real: plain pickle runs it (so the refusals above mean something)."""
    canary = tmp_path / "ran"
    pickle.loads(_call(4, "torch.distributed.checkpoint.metadata", "os.system", f"touch {canary}"))
    assert canary.exists()


class _Exploit:
    def __init__(self, canary):
        self.canary = canary

    def __reduce__(self):
        return (os.system, (f"touch {self.canary}",))


def test_byte_entries_are_refused_without_unpickling_them(tmp_path):
    """DCP would torch.load(weights_only=False) an entry declared as bytes."""
    canary = tmp_path / "pwned"
    _save({"model/w": torch.zeros(2), "model/x": _Exploit(canary)}, tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=r"\.metadata: refused to load .*BytesStorageMetadata"):
        safe_load({"model/w": torch.zeros(2), "model/x": torch.zeros(2)}, str(tmp_path / "ckpt"))
    assert not canary.exists()


def test_storage_paths_outside_the_directory_are_refused(tmp_path):
    _save({"model/w": torch.zeros(2)}, tmp_path)
    with open(tmp_path / ".metadata", "rb") as f:
        meta = pickle.load(f)
    for info in meta.storage_data.values():
        info.relative_path = "../../outside.distcp"
    with open(tmp_path / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        read_metadata(str(tmp_path))


@pytest.mark.parametrize("content", [b"", b"\x80\x04garbage", b"not a pickle at all"])
def test_truncated_or_garbage_metadata_is_one_line(tmp_path, content):
    (tmp_path / ".metadata").write_bytes(content)
    with pytest.raises(CheckpointError, match=r"\.metadata: refused to load"):
        read_metadata(str(tmp_path))


def test_missing_metadata_names_the_file(tmp_path):
    with pytest.raises(CheckpointError, match=r"\.metadata: missing"):
        read_metadata(str(tmp_path))
