"""Beyond one machine: two torchrun "nodes" on loopback, SLURM tasks simulated through their
environment (ranks, layout checks, the warning signal's save-then-requeue), and an Optuna sweep
whose trials are multi-process runs. References: the single-process run in float64."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import pytest
import yaml

from conftest import SMALL, compose_config, launch_cmd, launch_py, read_metrics, run_training
from megatron_hydra import slurm
from megatron_hydra.config import derive
from megatron_hydra.config.io import free_port
from megatron_hydra.errors import ConfigError
from megatron_hydra.launcher import ExternalLaunch, check_external_layout, detect_external

STEPS = 3
FP64 = [*SMALL, "precision=fp64", f"trainer.max_steps={STEPS}"]
# Two ranks each (a worker process is most of a test's cost): tensor parallelism across two
# one-rank torchrun nodes, and a pipeline within one two-task SLURM node (local ranks 0 and 1).
TP2_2X1 = ["parallel=tp2", "trainer.devices=1", "trainer.num_nodes=2"]
PP2_1X2 = ["parallel=pp2", "trainer.devices=2", "trainer.num_nodes=1"]


def _losses(rows):
    return [r["loss"] for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def single_losses(tmp_path_factory):
    return _losses(run_training(FP64, tmp_path_factory.mktemp("single")))


# Node lists and tasks per node -------------------------------------------------------------------
@pytest.mark.parametrize("nodelist,hosts", [
    ("node[01-03,7]", ["node01", "node02", "node03", "node7"]),
    ("gpu[003-005,007],login1", ["gpu003", "gpu004", "gpu005", "gpu007", "login1"]),
    ("a1,b2", ["a1", "b2"]),
    ("r[1-2]n[8-9]", ["r1n8", "r1n9", "r2n8", "r2n9"]),
    ("dgx-[098-101]", ["dgx-098", "dgx-099", "dgx-100", "dgx-101"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert slurm.expand_nodelist(nodelist) == hosts


def test_expand_tasks_per_node():
    assert slurm.expand_tasks_per_node("4(x2),3") == [4, 4, 3]
    assert slurm.expand_tasks_per_node("8") == [8]
    with pytest.raises(ConfigError, match="tasks per node"):
        slurm.expand_tasks_per_node("4x2")


def _slurm_env(procid, ntasks=4, per_node=2, job_id=4242, nodelist="localhost,node02"):
    return {"SLURM_PROCID": str(procid), "SLURM_LOCALID": str(procid % per_node), "SLURM_NODEID": str(procid // per_node),
            "SLURM_NTASKS": str(ntasks), "SLURM_STEP_NUM_TASKS": str(ntasks),
            "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{ntasks // per_node})", "SLURM_STEP_NUM_NODES": str(ntasks // per_node),
            "SLURM_JOB_NODELIST": nodelist, "SLURM_JOB_ID": str(job_id)}


def test_slurm_detection_and_rendezvous():
    s = detect_external(_slurm_env(3, nodelist="node[01-03,7]"))
    assert s == ExternalLaunch("slurm", rank=3, local_rank=1, world_size=4, local_world_size=2, node_rank=1, num_nodes=2)
    rdzv = slurm.rendezvous_env(_slurm_env(3, nodelist="node[01-03,7]"))
    assert rdzv["MASTER_ADDR"] == "node01" and rdzv["MASTER_PORT"] == str(20000 + 4242)
    assert slurm.rendezvous_env({**_slurm_env(0), "MASTER_PORT": "1234"})["MASTER_PORT"] == "1234"
    t = detect_external({"TORCHELASTIC_RUN_ID": "x", "RANK": "6", "LOCAL_RANK": "2", "WORLD_SIZE": "8",
                         "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1"})
    assert (t.node_rank, t.num_nodes) == (1, 2)


@pytest.mark.parametrize("launch,message", [
    (ExternalLaunch("slurm", 0, 0, 8, 4, 0, 2), "has 8 ranks but trainer.devices x trainer.num_nodes = 2x2 = 4"),
    (ExternalLaunch("torchrun", 0, 0, 4, 4, 0, 1), "runs 4 ranks on node 0 but trainer.devices=2"),
])
def test_rank_layout_mismatch_is_a_config_error(launch, message):
    cfg = compose_config([*SMALL, "parallel=tp2_pp2", "trainer.devices=2", "trainer.num_nodes=2"])
    with pytest.raises(ConfigError, match=message):
        check_external_layout(cfg, derive(cfg), launch)
    check_external_layout(cfg, derive(cfg), ExternalLaunch("slurm", 3, 1, 4, 2, 1, 2))  # the matching one


def test_slurm_launcher_config_maps_the_run_onto_sbatch(tmp_path, monkeypatch):
    """hydra/launcher=slurm through the plugin's own parameter mapping, down to the sbatch lines;
    submitit's requeue is off and its warning signal is one the checkpoint callback owns."""
    import submitit
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import instantiate
    from lightning_fabric.plugins.environments import SLURMEnvironment
    from submitit.slurm.slurm import _make_sbatch_string

    from conftest import CONF
    from megatron_hydra.training.checkpointing import WARNING_SIGNALS
    from megatron_hydra.config import register_configs
    from megatron_hydra.training.strategy import _ProcessGroupEnvironment

    register_configs()

    (tmp_path / "srun").write_text("#!/bin/sh\n")  # submitit's executor looks for srun on PATH
    (tmp_path / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="config", return_hydra_config=True, overrides=[
            "run_dir=unused", "hydra/launcher=slurm", "trainer.num_nodes=4", "trainer.devices=8",
            "hydra.launcher.partition=gpu", "hydra.launcher.account=proj", f"hydra.sweep.dir={tmp_path}"])
    monkeypatch.setattr(HydraConfig.instance(), "cfg", None)  # restored after the test
    HydraConfig.instance().set_config(cfg)
    launcher = instantiate(cfg.hydra.launcher)
    launcher.config = cfg
    captured = {}

    def capture(executor, fn, *args):
        captured["sbatch"] = _make_sbatch_string(command="python -m submitit.core._submit", folder=str(tmp_path),
                                                 **executor._executor.parameters)
        captured["max_num_timeout"] = executor._executor.max_num_timeout
        return []

    monkeypatch.setattr(submitit.AutoExecutor, "map_array", capture)
    launcher.launch([["optim.lr=1e-3"]], initial_job_idx=0)
    lines = set(captured["sbatch"].splitlines())
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=gpu", "#SBATCH --account=proj", "#SBATCH --signal=USR2@300"):
        assert line in lines, captured["sbatch"]
    assert captured["max_num_timeout"] == 0
    assert signal.SIGUSR2 in WARNING_SIGNALS
    assert not issubclass(_ProcessGroupEnvironment, SLURMEnvironment)  # Lightning's auto-requeue stays off


# Two torchrun nodes on loopback --------------------------------------------------------------------
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_two_torchrun_nodes_match_single_process(tmp_path, env_no_launcher, single_losses):
    endpoint = f"127.0.0.1:{free_port()}"
    args = [*FP64, *TP2_2X1, f"hydra.run.dir={tmp_path}"]
    agents = [subprocess.Popen(["torchrun", "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
                                "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "two-nodes",
                                launch_cmd()[1], *args],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env_no_launcher)
              for node in (0, 1)]
    outputs = [a.communicate(timeout=240)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    derived = yaml.safe_load((tmp_path / "derived.yaml").read_text())
    assert (derived["world_size"], derived["tp"], derived["pp"], derived["dp"]) == (2, 2, 1, 1)
    assert _losses(read_metrics(tmp_path)) == pytest.approx(single_losses, rel=1e-9)


# SLURM tasks simulated through their variables -------------------------------------------------------
def _start_tasks(n, per_node, overrides, run_dir, env, log_dir):
    """``n`` processes as an srun step would start them: the same command, each with its task's
    variables (and MASTER_PORT set, since the job id's port may be taken on this machine)."""
    port = str(free_port())
    procs = []
    for task in range(n):
        task_env = {**env, **_slurm_env(task, ntasks=n, per_node=per_node), "MASTER_PORT": port}
        out = open(log_dir / f"task{task}.log", "w")
        procs.append(subprocess.Popen(launch_cmd(*overrides, f"hydra.run.dir={run_dir}"), env=task_env,
                                      stdout=out, stderr=subprocess.STDOUT))
    return procs


def _logs(log_dir):
    return "\n".join(p.read_text()[-1500:] for p in sorted(log_dir.glob("task*.log")))


def test_simulated_slurm_step_trains_like_one_process(tmp_path, env_no_launcher, single_losses):
    # Under submitit (SUBMITIT_EXECUTOR set) a worker returns from the task function so submitit
    # can record its result: the interpreter's own exit after pipeline traffic must be clean, and
    # validation (its own pipeline schedule) runs at the last step.
    env = {**env_no_launcher, "SUBMITIT_EXECUTOR": "slurm"}
    validation = [f"trainer.val_check_interval={STEPS}", "trainer.limit_val_batches=1"]
    procs = _start_tasks(2, 2, [*FP64, *PP2_1X2, *validation], tmp_path / "run", env, tmp_path)
    codes = [p.wait(timeout=240) for p in procs]
    assert codes == [0] * 2, _logs(tmp_path)
    derived = yaml.safe_load((tmp_path / "run" / "derived.yaml").read_text())
    assert (derived["world_size"], derived["tp"], derived["pp"]) == (2, 1, 2)
    rows = read_metrics(tmp_path / "run")
    assert _losses(rows) == pytest.approx(single_losses, rel=1e-9)
    assert "val_loss" in rows[-1]


def test_simulated_slurm_step_with_wrong_layout_fails_in_one_line(tmp_path, env_no_launcher, capsys):
    # Refused before any process group: launch.py runs in this process (conftest.launch_py).
    env = {**env_no_launcher, **_slurm_env(0, ntasks=4, per_node=4)}
    code = launch_py([*SMALL, "trainer.devices=2", f"hydra.run.dir={tmp_path}"], env)
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert err.strip().splitlines()[-1] == (
        "error: the slurm launch has 4 ranks but trainer.devices x trainer.num_nodes = 2x1 = 2: make them agree "
        "(SLURM --nodes/--ntasks-per-node)")


def _wait_for(path, text, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.2)
    raise AssertionError(f"{text!r} never appeared in {path}")


def test_slurm_warning_signal_saves_then_requeues_once(tmp_path, env_no_launcher):
    # A stand-in for scontrol records how it was called; SLURM signals every task of the step.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol_calls.txt"
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n")
    (bin_dir / "scontrol").chmod(0o755)
    env = {**env_no_launcher, "PATH": f"{bin_dir}{os.pathsep}{env_no_launcher['PATH']}"}
    overrides = [*SMALL, "trainer.devices=2", "trainer.max_steps=5000", "optim.decay_steps=5000"]
    procs = _start_tasks(2, 2, overrides, tmp_path / "run", env, tmp_path)
    try:
        _wait_for(tmp_path / "task0.log", "training starts at step 0")
        time.sleep(1)  # a few steps, and every task past its own start
        for p in procs:
            p.send_signal(signal.SIGUSR2)
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert codes == [0, 0], _logs(tmp_path)
    saved = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))
    assert len(saved) == 1 and 0 < int(saved[0].name.split("_")[1]) < 5000
    assert calls.read_text().splitlines() == ["requeue 4242"]


# Optuna sweep of multi-process runs -----------------------------------------------------------------
def test_optuna_sweep_reports_the_best_trial(tmp_path, env_no_launcher, capfd):
    # One-rank trials: multirun jobs of several ranks are test_launcher.py's multirun test. Hydra's
    # sweep is not about the process boundary: launch.py runs in this process (conftest.launch_py).
    code = launch_py(["-m", "hydra/sweeper=lr_search", "hydra.sweeper.n_trials=2", "hydra.sweeper.sampler.n_startup_trials=2",
                      *[o for o in SMALL if not o.startswith("optim.warmup_steps=")],
                      "optim.warmup_steps=choice(0,1)", "trainer.max_steps=2", "trainer.val_check_interval=2",
                      "trainer.limit_val_batches=1", "checkpoint.save_last=false", f"hydra.sweep.dir={tmp_path}"],
                     env_no_launcher)
    assert code == 0, capfd.readouterr().err[-3000:]
    finals = {}
    for job in sorted(p for p in tmp_path.iterdir() if p.is_dir() and p.name.isdigit()):
        rows = read_metrics(job)
        finals[job.name] = [r["val_loss"] for r in rows if "val_loss" in r][-1]
        assert yaml.safe_load((job / "derived.yaml").read_text())["world_size"] == 1
    assert sorted(finals) == ["0", "1"]
    result = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())
    assert result["best_value"] == pytest.approx(min(finals.values()), rel=1e-12)
    best_job = min(finals, key=finals.get)
    job_overrides = yaml.safe_load((tmp_path / best_job / ".hydra" / "overrides.yaml").read_text())
    assert f"optim.lr={result['best_params']['optim.lr']}" in job_overrides
    assert f"optim.warmup_steps={result['best_params']['optim.warmup_steps']}" in job_overrides


def test_optuna_sweep_without_validation_is_a_config_error(tmp_path, env_no_launcher, capsys):
    code = launch_py(["-m", "hydra/sweeper=lr_search", "hydra.sweeper.n_trials=1", *SMALL, f"hydra.sweep.dir={tmp_path}"],
                     env_no_launcher)
    assert code == 2
    assert "trainer.val_check_interval=0 disables validation" in capsys.readouterr().err
