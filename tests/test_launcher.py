"""The launch path as a user meets it: launch.py in a subprocess, multirun, failures, torchrun."""

from __future__ import annotations

import subprocess


from conftest import SMALL, launch_cmd, read_metrics
from test_report import check_report
from megatron_hydra.launcher import detect_external, slurm_rendezvous_env


def _run(args, env, timeout=240, **kwargs):
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, **kwargs)


def test_default_run_trains_with_falling_loss(tmp_path, env_no_launcher):
    # The default data (demo corpus), built into a private cache so the test starts from nothing.
    out = _run(launch_cmd("trainer.max_steps=10", "optim.warmup_steps=4", "trainer.enable_progress_bar=false",
                          f"data.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={tmp_path}"), env_no_launcher)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert len(rows) == 10
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-5:]) / 5
    assert last < first - 0.5, (first, last)
    for key in ("lr", "grad_norm", "tokens_per_s", "tflops_per_rank", "consumed_samples"):
        assert key in rows[-1]
    assert (tmp_path / "resolved_config.yaml").exists() and (tmp_path / ".hydra" / "config.yaml").exists()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert "sample from the trained model:\ndef main(" in out.stderr + out.stdout  # trainer.generate_sample_tokens


def test_multirun_two_jobs_of_two_ranks(tmp_path, env_no_launcher):
    out = _run(launch_cmd("-m", "optim.lr=1e-3,3e-4", "trainer.devices=2", "trainer.max_steps=3", *SMALL,
                          f"hydra.sweep.dir={tmp_path}"), env_no_launcher)
    assert out.returncode == 0, out.stderr[-3000:]
    jobs = sorted(p for p in tmp_path.iterdir() if p.is_dir() and p.name.isdigit())
    assert [j.name for j in jobs] == ["0", "1"]
    lrs = []
    for job in jobs:
        rows = read_metrics(job)
        assert len(rows) == 3
        lrs.append(rows[-1]["lr"])
    assert lrs[0] > lrs[1]  # each job ran with its own lr
    check_report(tmp_path, seq_length=32)  # python -m megatron_hydra.report on this sweep (test_report.py)


# A failing worker stops the run quickly: test_launcher_trust.py (with stale error files around).
# launch.py run by torchrun as its workers: test_cluster_launch.py's two torchrun nodes (exact
# against one process).


def test_detects_torchrun_and_slurm_from_environment():
    assert detect_external({}) is None
    assert detect_external({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None  # sbatch, one task
    # A batch script of an 8-task allocation running python itself (no srun step): not a worker.
    assert detect_external({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}) is None
    t = detect_external({"TORCHELASTIC_RUN_ID": "x", "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8",
                         "LOCAL_WORLD_SIZE": "4"})
    assert (t.kind, t.rank, t.local_rank, t.world_size, t.local_world_size) == ("torchrun", 3, 1, 8, 4)
    env = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8",
           "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
           "SLURM_JOB_NODELIST": "gpu[007-008]", "SLURM_JOB_ID": "12345"}
    s = detect_external(env)
    assert (s.kind, s.rank, s.local_rank, s.world_size, s.local_world_size) == ("slurm", 5, 1, 8, 4)
    rdzv = slurm_rendezvous_env(env)
    assert rdzv == {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "MASTER_ADDR": "gpu007",
                    "MASTER_PORT": str(20000 + 12345 % 20000)}
