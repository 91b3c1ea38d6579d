"""Checkpoints are trusted only when they are whole and fit: files carry checksums verified on
load, meta.json errors are one line, a checkpoint of a bigger model never loads into a smaller one,
consumed samples are carried as saved, and leftovers of interrupted saves and prunes are removed."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import SMALL, compose_config, preflight_error, run_training, spawn_ranks
from megatron_hydra.errors import CheckpointError


@pytest.fixture
def ckpt(small_checkpoint):
    return small_checkpoint


def copy_of(ckpt, tmp_path, name="step_0000002"):
    dest = tmp_path / name
    shutil.copytree(ckpt, dest)
    return dest


def _flip_inside_tensor(path, name: str) -> str:
    """Flip one byte inside the stored data of the logical tensor ``name`` (found by its own bytes,
    read back independently of the checksums); returns the file changed."""
    import torch.distributed.checkpoint as dcp

    from megatron_hydra.checkpoint.safe_reader import read_metadata

    size = read_metadata(str(path)).state_dict_metadata[f"model/{name}"].size
    target = {f"model/{name}": torch.empty(size)}
    dcp.load(target, checkpoint_id=str(path), no_dist=True)
    raw = target[f"model/{name}"].numpy().tobytes()
    for file in sorted(path.glob("*.distcp")):
        data = bytearray(file.read_bytes())
        at = data.find(raw)
        if at >= 0:
            data[at + len(raw) // 2] ^= 0x40
            file.write_bytes(bytes(data))
            return file.name
    raise AssertionError(f"{name} not found in the shard files")


# Item 2 (shards carry checksums) and item 11 (missing / truncated shard, broken meta.json) -------
def test_corrupted_shard_is_refused_naming_the_file(tmp_path, ckpt):
    from megatron_hydra.checkpoint.standalone import load_model

    bad = copy_of(ckpt, tmp_path)
    changed = _flip_inside_tensor(bad, "layers.0.mlp.fc1.weight")
    with pytest.raises(CheckpointError, match=f"{changed} does not match its SHA-256") as err:
        load_model(str(bad))
    assert "\n" not in str(err.value)
    # A training run from it stops at load, before any step.
    with pytest.raises(CheckpointError, match=changed):
        run_training([*SMALL, "trainer.max_steps=3", f"checkpoint.load={bad}"], tmp_path / "run")
    assert not list((tmp_path / "run").glob("checkpoints/step_*"))


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_missing_or_truncated_shard_is_one_line_naming_the_file(tmp_path, ckpt, damage):
    bad = copy_of(ckpt, tmp_path)
    shard = sorted(bad.glob("*.distcp"))[0]
    if damage == "missing":
        shard.unlink()
    else:
        shard.write_bytes(shard.read_bytes()[:1000])
    message = preflight_error(tmp_path, f"checkpoint.load={bad}")
    assert shard.name in message and ("missing" if damage == "missing" else "truncated") in message
    assert not (tmp_path / "new" / "csv").exists()  # refused before training started


@pytest.mark.parametrize("content,key", [('{"step": 2,', "not valid JSON"), ("drop shapes", "'shapes'"),
                                         ("step as text", "'step'")])
def test_broken_meta_json_is_one_line_naming_file_and_key(tmp_path, ckpt, content, key):
    bad = copy_of(ckpt, tmp_path)
    meta_file = bad / "meta.json"
    if content == "drop shapes":
        meta = json.loads(meta_file.read_text())
        del meta["shapes"]
        meta_file.write_text(json.dumps(meta))
    elif content == "step as text":
        meta = json.loads(meta_file.read_text())
        meta["step"] = "two"
        meta_file.write_text(json.dumps(meta))
    else:
        meta_file.write_text(content)
    message = preflight_error(tmp_path, f"checkpoint.load={bad}")
    assert str(meta_file) in message and key in message


# Item 12: strict matching: more layers never load into a smaller model ---------------------------
def test_checkpoint_with_more_layers_is_refused(tmp_path, ckpt):
    for extra in ([], ["checkpoint.load_optimizer=false"]):  # weights only: still every layer
        message = preflight_error(tmp_path, f"checkpoint.load={ckpt}", "model.num_layers=1", *extra)
        assert "layers.1." in message and "2 layers there, 1 in this model" in message


def test_worker_side_refuses_unloaded_tensors(ckpt):
    """The loader's own check, against DCP's metadata (not meta.json): one process."""
    from megatron_hydra.checkpoint.sharded import load
    from megatron_hydra.config import derive
    from megatron_hydra.parallel.state import ParallelState
    from megatron_hydra.training.module import LMModule

    cfg = compose_config([*SMALL, "model.num_layers=1"])
    module = LMModule(cfg, derive(cfg), ParallelState.single())
    with pytest.raises(CheckpointError, match="has tensor layers.1.* that this model lacks"):
        load(str(ckpt), module.model, None, module.ps, 500, load_optimizer=False)


def _consumed_by_stages(rank, world):
    """Two pipeline stages, one layer each: together they take a 2-layer checkpoint whole, and
    only together can they tell that a 3-layer checkpoint's third layer is taken by nobody."""
    from megatron_hydra.checkpoint.sharded import check_consumed

    mine = {f"layers.{rank}.w": [2]}
    outcome = []
    for layers in (2, 3):
        saved = {f"layers.{i}.w": [2] for i in range(layers)}
        try:
            check_consumed("ckpt", saved, mine, torch.device("cpu"))
            outcome.append(None)
        except CheckpointError as e:
            outcome.append(str(e))
    return outcome


def test_pipeline_ranks_together_refuse_a_layer_nobody_loads():
    results = spawn_ranks(_consumed_by_stages, 2)
    for rank in (0, 1):
        two, three = results[rank]
        assert two is None, two
        assert three is not None and "layers.2.w" in three and "3 layers there, 2 in this model" in three


# Item 6: consumed samples are carried, not recomputed from the batch size ------------------------
def test_consumed_samples_survive_a_global_batch_change(tmp_path):
    run_training([*SMALL, "trainer.max_steps=4"], tmp_path)  # 4 steps x 8 samples
    rows = run_training([*SMALL, "trainer.max_steps=6", "data.global_batch_size=16"], tmp_path)
    assert [r["consumed_samples"] for r in rows if r["step"] >= 4] == [32 + 16, 32 + 32]
    meta = json.loads((tmp_path / "checkpoints" / "step_0000006" / "meta.json").read_text())
    assert meta["step"] == 6 and meta["consumed_samples"] == 64  # not 6 x 16 = 96


# Item 12: leftovers of interrupted saves and prunes ----------------------------------------------
def test_half_pruned_and_stale_directories_are_removed_at_start(tmp_path, ckpt):
    root = tmp_path / "checkpoints"
    copy_of(ckpt, root)
    half_pruned = copy_of(ckpt, root, "step_0000007")  # prune killed after removing the marker
    (half_pruned / "COMPLETE").unlink()
    (half_pruned / "meta.json").unlink()
    stale = copy_of(ckpt, root, "step_0000008.tmp")  # a save killed before its commit
    (stale / "COMPLETE").unlink()
    rows = run_training([*SMALL, "trainer.max_steps=3"], tmp_path)
    assert [r["step"] for r in rows][-1:] == [2.0]  # resumed from the complete checkpoint, not from them
    assert sorted(p.name for p in root.glob("step_*")) == ["step_0000002", "step_0000003"]


def test_a_finished_save_that_missed_its_rename_is_moved_into_place(tmp_path, ckpt):
    from megatron_hydra.checkpoint import store

    written = copy_of(ckpt, tmp_path, "step_0000002.tmp")  # marker written, killed before the rename
    assert store.clean(str(tmp_path)) == []
    assert store.latest(str(tmp_path)) == str(tmp_path / "step_0000002") and not written.exists()
