"""A checkpoint directory is hostile data, and ``checkpoint.dir`` belongs to one run: a fresh run
never mixes its checkpoints with another run's (nor deletes its own), retention never follows a
link, and crafted files (a FIFO, deep JSON, out-of-range values, damaged random states, a config
describing a huge model) are one line within seconds, as is a full disk during a save."""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pytest
import torch
import yaml

from conftest import ROOT, SMALL, compose_config, preflight_error, run_training
from megatron_hydra.checkpoint import sharded, store
from megatron_hydra.errors import CheckpointError, ConfigError, MegatronHydraError

NO_SPACE = os.strerror(errno.ENOSPC)  # "No space left on device"


@pytest.fixture
def ckpt(small_checkpoint):
    return small_checkpoint


def copy_of(ckpt, where: Path, name: str = "step_0000002") -> Path:
    dest = where / name
    shutil.copytree(ckpt, dest)
    return dest


def edit_meta(path: Path, **changes) -> None:
    meta = json.loads((path / "meta.json").read_text())
    meta.update(changes)
    (path / "meta.json").write_text(json.dumps(meta))


def one_line(error: BaseException) -> str:
    message = str(error)
    assert "\n" not in message, message
    return message


def within(seconds: float, fn, *args):
    """``fn(*args)`` on a thread: its result, or the exception it raised; fails this test (and
    only this test) when the call has not returned in time, as a blocking open of a FIFO never
    does (``fifo`` below lets such a thread go afterwards)."""
    box = {}

    def call():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"{getattr(fn, '__name__', fn)} still blocked after {seconds} s")
    return box.get("error", box.get("value"))


@contextmanager
def fifo(path: Path):
    """``path`` replaced by a FIFO; afterwards a reader still blocked on it gets end-of-file."""
    if path.exists():
        path.unlink()
    os.mkfifo(path)
    try:
        yield path
    finally:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # ENXIO: nobody is reading it
            pass
        path.unlink()


def fake_checkpoint(root: Path, step: int) -> Path:
    """A directory that counts as a complete checkpoint for listing and retention."""
    path = root / f"step_{step:07d}"
    path.mkdir(parents=True)
    (path / "COMPLETE").write_text("ok\n")
    return path


def names(root: Path):
    return sorted(p.name for p in root.glob("step_*"))


# Severe 2: a fresh run deletes its own checkpoints ------------------------------------------------
def test_fresh_run_into_a_directory_with_another_runs_checkpoints_is_refused(tmp_path, ckpt):
    """Before: each save was followed by "(removed 1 older)", removing the checkpoint just written,
    and the run ended with none of its own (exit 0). Now the run is refused before it starts."""
    root = tmp_path / "checkpoints"
    for step in (100, 200):
        edit_meta(copy_of(ckpt, root, f"step_{step:07d}"), step=step)
    with pytest.raises(ConfigError) as err:
        run_training([*SMALL, "trainer.max_steps=2", "checkpoint.every_n_steps=1", "checkpoint.keep_last=2",
                      "checkpoint.resume=none"], tmp_path)
    message = one_line(err.value)
    assert f"checkpoint.dir={root}" in message and "step_0000200" in message
    assert "checkpoint.resume=auto" in message and "another checkpoint.dir" in message and "remove them" in message
    assert names(root) == ["step_0000100", "step_0000200"] and not (tmp_path / "csv").exists()


def test_a_save_that_missed_only_its_rename_counts_for_a_fresh_start(tmp_path):
    """A ``step_N.tmp`` with its marker is a finished save (``clean`` moves it into place when the
    next run starts): a fresh run into its directory is refused as for a ``step_N``."""
    from megatron_hydra.checkpoint.plan import fresh_start

    root = tmp_path / "checkpoints"
    os.replace(fake_checkpoint(root, 300), root / "step_0000300.tmp")
    with pytest.raises(ConfigError, match="newest: step_0000300.tmp"):
        fresh_start(str(root))
    (root / "step_0000300.tmp" / store.MARKER).unlink()  # an interrupted save: no checkpoint
    fresh_start(str(root))


def test_retention_deletes_only_checkpoints_older_than_the_one_just_written(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 100, 200):  # 100 and 200: another run's, higher than this run's steps
        fake_checkpoint(root, step)
    # keep_last=2 counts the one just written: step 2 stays with it.
    assert store.prune(str(root), 2, str(root / "step_0000003")) == [str(root / "step_0000001")]
    assert store.prune(str(root), 1, str(root / "step_0000003")) == [str(root / "step_0000002")]
    assert store.prune(str(root), 1, str(root / "step_0000003")) == []
    assert names(root) == ["step_0000003", "step_0000100", "step_0000200"]


# Smaller: retention and cleaning never follow a link -----------------------------------------------
def test_retention_and_cleaning_never_delete_through_a_link(tmp_path):
    elsewhere = fake_checkpoint(tmp_path / "elsewhere", 1)
    unfinished = tmp_path / "elsewhere" / "unfinished"
    unfinished.mkdir()
    (unfinished / "data").write_text("x")
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / "step_0000001").symlink_to(elsewhere, target_is_directory=True)  # oldest: first in line to go
    for step in (2, 3):
        fake_checkpoint(root, step)
    (root / "step_0000004").symlink_to(unfinished, target_is_directory=True)  # no marker: clean's
    (root / "step_0000005.tmp").symlink_to(unfinished, target_is_directory=True)

    assert store.prune(str(root), 1, str(root / "step_0000003")) == [str(root / "step_0000002")]
    assert store.clean(str(root)) == []
    assert names(root) == ["step_0000001", "step_0000003", "step_0000004", "step_0000005.tmp"]
    assert (elsewhere / "COMPLETE").is_file() and (unfinished / "data").is_file()


def test_a_link_in_the_checkpoint_directory_is_one_line_before_training(tmp_path, ckpt):
    """Before: resume=auto resumed through the link, and retention later removed the marker of the
    directory it pointed to, then failed with a traceback."""
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    (root / "step_0000002").symlink_to(ckpt, target_is_directory=True)
    with pytest.raises(CheckpointError) as err:
        run_training([*SMALL, "trainer.max_steps=3"], tmp_path / "run")
    message = one_line(err.value)
    assert str(root / "step_0000002") in message and "symbolic link" in message and "remove the link" in message
    assert not (tmp_path / "run" / "csv").exists() and (ckpt / "COMPLETE").is_file()


def test_checkpoint_load_of_a_link_names_the_directory_to_give(tmp_path, ckpt):
    link = tmp_path / "latest"
    link.symlink_to(ckpt, target_is_directory=True)
    message = preflight_error(tmp_path, f"checkpoint.load={link}")
    assert "symbolic link" in message and f"checkpoint.load={os.path.realpath(ckpt)}" in message


# meta.json: regular file, bounded nesting, values in range ------------------------------------------
def test_meta_json_that_is_a_fifo_is_one_line_not_a_hang(tmp_path, ckpt):
    from megatron_hydra.checkpoint.plan import start_point
    from megatron_hydra.checkpoint.standalone import read_config
    from megatron_hydra.config import derive

    bad = copy_of(ckpt, tmp_path)
    cfg = compose_config([*SMALL, f"checkpoint.load={bad}"], str(tmp_path / "new"))
    with fifo(bad / "meta.json"):
        for call, args in ((start_point, (cfg, derive(cfg))), (read_config, (str(bad),))):
            outcome = within(20, call, *args)
            assert isinstance(outcome, CheckpointError), outcome
            assert str(bad / "meta.json") in one_line(outcome) and "FIFO" in str(outcome)


def test_meta_json_nested_deep_is_one_line(tmp_path, ckpt):
    bad = copy_of(ckpt, tmp_path)
    (bad / "meta.json").write_text("[" * 100_000 + "]" * 100_000)
    message = preflight_error(tmp_path, f"checkpoint.load={bad}")
    assert str(bad / "meta.json") in message and "nested deeper" in message


@pytest.mark.parametrize("key,value", [("step", -5), ("step", 10**18), ("consumed_samples", 10**30),
                                       ("step", 3)], ids=["step_negative", "step_huge", "samples_huge",
                                                          "step_not_the_directorys"])
def test_meta_values_out_of_range_are_one_line_before_training(tmp_path, ckpt, key, value):
    """Before: step=-5 resumed at step -5 with a negative learning rate; a huge step or sample
    count ran no step at all; all exited 0."""
    bad = copy_of(ckpt, tmp_path)
    edit_meta(bad, **{key: value})
    message = preflight_error(tmp_path, f"checkpoint.load={bad}")
    assert str(bad / "meta.json") in message and f"key {key!r} is {value}" in message


# DCP's .metadata: regular file only -------------------------------------------------------------------
def test_unchecked_dcp_metadata_that_is_a_fifo_is_one_line_not_a_hang(tmp_path, ckpt):
    from megatron_hydra.checkpoint.safe_reader import read_metadata

    bad = copy_of(ckpt, tmp_path)
    meta = json.loads((bad / "meta.json").read_text())
    del meta["checksums"][".metadata"]  # not listed: nothing checks it before it is opened
    (bad / "meta.json").write_text(json.dumps(meta))
    with fifo(bad / ".metadata"):
        outcome = within(20, read_metadata, str(bad))
        assert isinstance(outcome, CheckpointError), outcome
        assert str(bad / ".metadata") in one_line(outcome) and "FIFO" in str(outcome)


# Random states ---------------------------------------------------------------------------------------
def _generators():
    return random.getstate(), torch.get_rng_state()


@pytest.mark.parametrize("damage", ["garbage", "wrong_structure", "fifo"])
def test_a_crafted_rng_file_changes_no_generator_and_warns_in_one_line(tmp_path, ckpt, caplog, damage):
    """Before: garbage bytes or a wrong structure raised a traceback out of torch.load or out of
    the restore, the latter after it had already replaced some of the generators."""
    bad = copy_of(ckpt, tmp_path)
    file = bad / "rng" / "rank_00000.pt"
    if damage == "garbage":
        file.write_bytes(os.urandom(3000))
    elif damage == "wrong_structure":  # genuine Python and NumPy states, a torch state of the wrong size
        state = torch.load(file, weights_only=True)
        state["python"]["internal"] = [7] * 624 + [624]
        state["torch"] = torch.zeros(3, dtype=torch.uint8)
        torch.save(state, file)
    before = _generators()
    with caplog.at_level(logging.WARNING, logger="megatron_hydra"):
        if damage == "fifo":
            with fifo(file):
                assert within(20, sharded.load_rng, str(bad)) is False
        else:
            assert sharded.load_rng(str(bad)) is False
    after = _generators()
    assert after[0] == before[0] and torch.equal(after[1], before[1])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(file) in warnings[0] and "fresh random states" in warnings[0]
    assert "\n" not in warnings[0]


# A full disk -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_full_disk_during_a_save_says_so_in_one_line(tmp_path, async_save):
    """Before: a synchronous save printed DCP's traceback wall; an asynchronous one said only
    "CheckpointException ranks:dict_keys([0])"."""
    import torch.distributed.checkpoint.filesystem as dcp_files

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, NO_SPACE)

    with mock.patch.object(dcp_files, "_write_item", full), pytest.raises(MegatronHydraError) as err:
        run_training([*SMALL, "trainer.max_steps=2", "checkpoint.every_n_steps=1",
                      f"checkpoint.async_save={str(async_save).lower()}"], tmp_path)
    message = one_line(err.value)
    assert isinstance(err.value, CheckpointError)
    assert NO_SPACE in message and str(tmp_path / "checkpoints" / "step_0000001") in message
    assert store.latest(str(tmp_path / "checkpoints")) is None


# A checkpoint whose config describes a huge model ---------------------------------------------------------
# Runs in its own process, its address space capped: a build that allocates the model before the
# checks fails there at once (instead of taking the machine's memory), and the test fails.
LOAD_EACH = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
from megatron_hydra.checkpoint.standalone import load_model
from megatron_hydra.errors import CheckpointError
out = {}
for path in sys.argv[1:]:
    try:
        load_model(path)
        out[path] = "loaded"
    except CheckpointError as e:
        out[path] = "CheckpointError: " + str(e)
    except BaseException as e:
        out[path] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def _with_model(ckpt, dest: Path, shapes_too: bool = False, **model) -> Path:
    """A copy of ``ckpt`` whose stored config has these ``model`` values (and, with
    ``shapes_too``, meta.json shapes to match, as a consistent crafted file would)."""
    from megatron_hydra.checkpoint.plan import logical_shapes
    from megatron_hydra.checkpoint.standalone import single_process
    from megatron_hydra.config.io import from_yaml

    path = copy_of(ckpt, dest)
    meta = json.loads((path / "meta.json").read_text())
    config = yaml.safe_load(meta["config"])
    config["model"].update(model)
    meta["config"] = yaml.safe_dump(config, sort_keys=False)
    if shapes_too:
        meta["shapes"] = logical_shapes(single_process(from_yaml(meta["config"], "crafted"))[1])
    (path / "meta.json").write_text(json.dumps(meta))
    return path


@pytest.fixture(scope="module")
def huge_loads(small_checkpoint, tmp_path_factory):
    where = tmp_path_factory.mktemp("huge")
    cases = {
        "many_layers": _with_model(small_checkpoint, where / "a", num_layers=100_000, hidden_size=65536),
        "wide": _with_model(small_checkpoint, where / "b", hidden_size=65536),
        "wide_and_shapes": _with_model(small_checkpoint, where / "c", shapes_too=True, hidden_size=65536),
        "genuine": copy_of(small_checkpoint, where / "d"),
    }
    done = subprocess.run([sys.executable, "-c", LOAD_EACH, *map(str, cases.values())], cwd=ROOT, timeout=60,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    return {case: (path, results[str(path)]) for case, path in cases.items()}


@pytest.mark.parametrize("case,expected", [
    ("many_layers", "its config describes 100000 layers but its tensors hold 2"),
    ("wide", "tensor embedding.weight has shape [500, 64] there but [500, 65536] in this model"),
    ("wide_and_shapes", "its model tensors take"),
])
def test_a_huge_model_in_the_stored_config_is_refused_before_allocating(huge_loads, case, expected):
    """Before: the whole model was built (terabytes reserved) before any shape was checked."""
    path, outcome = huge_loads[case]
    assert outcome.startswith("CheckpointError: ") and "\n" not in outcome, outcome
    assert str(path) in outcome and expected in outcome, outcome
    assert huge_loads["genuine"][1] == "loaded"
