"""What a run records about itself: the W&B logger (offline), torch.profiler traces per rank, and
the peak memory per logged step; and their config checks, before any worker starts.

One two-rank run (data parallel) serves every check: its W&B run is read back from the records
wandb wrote, its traces as JSON, its metrics from csv/metrics.csv.
"""

from __future__ import annotations

import glob
import json
import struct
from unittest import mock

import pytest

from conftest import SMALL, compose_config, run_training
from megatron_hydra.config import derive
from megatron_hydra.errors import ConfigError

STEPS = 3
# trainer.wandb.mode rather than WANDB_MODE: the forked ranks get the fork server's environment,
# not this test's (conftest.spawn_ranks). No final checkpoint: no check reads one.
OBSERVED = [*SMALL, "trainer.devices=2", f"trainer.max_steps={STEPS}", "trainer.logger=[tensorboard,csv,wandb]",
            "trainer.wandb.mode=offline", "trainer.wandb.project=obs-test", "trainer.profile_steps=[1,2]",
            "checkpoint.save_last=false"]


@pytest.fixture(scope="module")
def observed_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("observed")
    return run_dir, run_training(OBSERVED, run_dir)


def wandb_records(path: str):
    """The protobuf records of a ``run-*.wandb`` file: after its 7-byte header (``:W&B``, magic,
    version), LevelDB log records (4-byte CRC, 2-byte length, 1-byte type: full, first, middle,
    last) in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, parts = open(path, "rb").read(), 7, 32768, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        parts, pos = parts + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # full or last: a whole record
            record = pb.Record()
            record.ParseFromString(parts)
            yield record
            parts = b""


def test_wandb_offline_run_holds_the_config_and_the_metrics(observed_run):
    run_dir, rows = observed_run
    runs = glob.glob(str(run_dir / "wandb" / "offline-run-*"))
    assert len(runs) == 1  # rank 0's only
    (path,) = glob.glob(f"{runs[0]}/run-*.wandb")
    records = list(wandb_records(path))
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.project == "obs-test"
    assert run.display_name == f"{run_dir.parent.name}/{run_dir.name}" and run.run_group == run_dir.parent.name
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["trainer"]["max_steps"] == STEPS and config["model"]["hidden_size"] == 64
    assert config["trainer"]["profile_steps"] == [1, 2] and config["run_dir"] == str(run_dir)
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [h["trainer/global_step"] for h in history] == [r["step"] for r in rows]
    assert [h["loss"] for h in history] == pytest.approx([r["loss"] for r in rows], rel=1e-6)


def test_profiler_writes_a_chrome_trace_per_rank_of_the_chosen_steps(observed_run):
    run_dir, _ = observed_run
    for rank in (0, 1):
        with open(run_dir / "profile" / f"rank{rank}.json") as f:
            trace = json.load(f)
        steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
        assert steps == {"ProfilerStep#1", "ProfilerStep#2"}, steps  # first..last, both included
        assert any(e.get("name", "").startswith("aten::") for e in trace["traceEvents"])


def test_peak_memory_is_logged_every_step_and_exceeds_the_parameters(observed_run):
    _, rows = observed_run
    # SMALL's GPT by hand: vocab 500 padded to 512, h=64, 32 positions, 2 layers (QKV, proj, two MLP
    # matrices with biases, two layer norms), final norm; tied embeddings. fp32 weights, grads and
    # AdamW's two moments: 16 bytes per parameter at least.
    h, layers = 64, 2
    params = 512 * h + 32 * h + layers * (12 * h * h + 13 * h) + 2 * h
    assert len(rows) == STEPS
    for row in rows:
        assert 16 * params / 2**30 < row["peak_memory_gib"] < 64  # an RSS on CPU: the interpreter and torch too


def _config_error(*overrides) -> str:
    with pytest.raises(ConfigError) as err:
        derive(compose_config([*SMALL, "trainer.max_steps=5", *overrides]))
    assert "\n" not in str(err.value)
    return str(err.value)


def test_bad_profile_steps_and_loggers_are_one_line_config_errors():
    assert "trainer.profile_steps=[3]" in _config_error("trainer.profile_steps=[3]")
    assert "first <= last" in _config_error("trainer.profile_steps=[3,2]")
    assert "< trainer.max_steps=5" in _config_error("trainer.profile_steps=[4,5]")
    assert "0 <= first" in _config_error("trainer.profile_steps=[-1,2]")
    assert "'mlflow' is not a logger" in _config_error("trainer.logger=[csv,mlflow]")
    assert "twice" in _config_error("trainer.logger=[csv,csv]")
    assert "trainer.wandb.mode='remote'" in _config_error("trainer.wandb.mode=remote")
    derive(compose_config([*SMALL, "trainer.max_steps=5", "trainer.profile_steps=[0,4]", "trainer.logger=[csv]"]))


def test_wandb_logger_without_wandb_installed_stops_before_workers_start(tmp_path):
    from megatron_hydra import launcher
    from megatron_hydra.config import observability

    real = observability.find_spec
    with mock.patch.object(observability, "find_spec", lambda name: None if name == "wandb" else real(name)), \
            pytest.raises(ConfigError) as err:
        launcher.run(compose_config([*SMALL, "trainer.max_steps=2", "trainer.logger=[csv,wandb]"], str(tmp_path)))
    message = str(err.value)
    assert "\n" not in message and "trainer.logger" in message and "pip install '.[wandb]'" in message
    assert not (tmp_path / "csv").exists()


def test_optuna_sweep_needs_the_csv_logger():
    """The sweep objective (the final validation loss) is read from csv/metrics.csv."""
    import importlib.util

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location("launch_entry", ROOT / "launch.py")
    launch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launch)
    cfg = compose_config([*SMALL, "trainer.val_check_interval=5", "trainer.logger=[tensorboard]"])
    with mock.patch("hydra.core.hydra_config.HydraConfig") as hydra_config:
        hydra_config.get.return_value.sweeper = {"_target_": "hydra_plugins.hydra_optuna_sweeper.OptunaSweeper"}
        with pytest.raises(ConfigError, match=r"trainer.logger=\['tensorboard'\] has no csv: add it"):
            launch._check_sweep_objective(cfg)
        cfg.trainer.logger = ["csv"]
        launch._check_sweep_objective(cfg)
