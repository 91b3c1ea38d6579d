"""Launcher refusals and failure reports (issue: trust): unknown keys, bad YAML, unwritable or
busy directories, too many local workers, blaming the right rank, sweeps that outlive a failed job.

The refusals that end ``launch.py`` before any worker starts, and a sweep of one-process jobs
(which train in the launcher's own process), run it in this process (``conftest.launch_py``: its
own ``__main__`` block, Hydra's parsing and exit status); the same one-line error from a fresh
interpreter is test_config.py's ``launch.py`` test. Runs that start workers (a failing rank, a
directory in use) are separate processes here."""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import ROOT, SMALL, compose_config, launch_cmd, launch_py, rank1_failure_injector, read_metrics
from megatron_hydra.config import derive
from megatron_hydra.errors import ConfigError


def _run(args, env, timeout=180):
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)


def _launch_in_process(argv, env, capsys) -> SimpleNamespace:
    """``python launch.py *argv``'s exit status and output, run in this process."""
    capsys.readouterr()
    code = launch_py(argv, env)
    captured = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=captured.out, stderr=captured.err)


def _one_error_line(out) -> str:
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert "Traceback" not in out.stdout + out.stderr, out.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr[-2000:]
    return lines[0]


def test_unknown_override_key_is_refused(tmp_path, env_no_launcher, capsys):
    from hydra import compose, initialize_config_dir

    from conftest import CONF
    from megatron_hydra.config import register_configs
    from megatron_hydra.config.known_keys import check_known_keys

    register_configs()
    out = _launch_in_process(["+unknown.key=1", "mode=plan", f"hydra.run.dir={tmp_path}"], env_no_launcher, capsys)
    assert out.returncode == 2
    assert "'unknown.key'" in _one_error_line(out)
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        for key, known in (("+trainer.max_step=5", False), ("+data.tokenizer.vocab=1", False),
                           ("cluster=h200_x1024", True)):
            cfg = compose(config_name="config", overrides=["run_dir=x", key])
            if known:
                check_known_keys(cfg)
            else:
                with pytest.raises(ConfigError, match=repr(key[1:].split("=")[0])):
                    check_known_keys(cfg)


def test_unknown_group_option_and_comma_list_without_m_are_one_line(tmp_path, env_no_launcher, capsys):
    # Hydra's own multi-line texts, before any worker.
    cases = {"model=gpt_does_not_exist": ["config group 'model' has no option 'gpt_does_not_exist'",
                                          "available: ", "gpt_125m, gpt_175b", "moe_tiny"],
             "data.split=100,0": ["is a sweep", "\"data.split='100,0'\"", "data.split=[100,0]"]}
    for i, (arg, parts) in enumerate(cases.items()):
        out = _launch_in_process([arg, "mode=plan", f"hydra.run.dir={tmp_path / str(i)}"], env_no_launcher, capsys)
        assert out.returncode == 2, out.stderr[-2000:]
        line = _one_error_line(out)
        assert line.startswith(f"error: {arg}: ") and all(p in line for p in parts), line
    # A comma list of config group options means several runs: the fix is -m, not quoting.
    spec = importlib.util.spec_from_file_location("launch_script", ROOT / "launch.py")
    launch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launch)
    line = launch._sweep_outside_multirun("model=gpt_tiny,moe_tiny")
    assert "sweep over config group 'model'" in line and "add -m" in line and "[" not in line


def test_yaml_syntax_error_in_own_config_is_one_line(tmp_path, env_no_launcher, capsys):
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "mine.yaml").write_text("defaults:\n  - config\n  - _self_\ntrainer:\n  max_steps: [1, 2\n")
    out = _launch_in_process(["--config-dir", str(conf), "--config-name", "mine", "mode=plan",
                              f"hydra.run.dir={tmp_path / 'run'}"], env_no_launcher, capsys)
    assert out.returncode == 2
    line = _one_error_line(out)
    assert str(conf / "mine.yaml") in line and "line 6" in line


def test_unwritable_run_dir_is_one_line(tmp_path, env_no_launcher, capsys):
    # As root no permission bit stops a write: a path through a regular file is unwritable for anyone.
    (tmp_path / "afile").write_text("")
    out = _launch_in_process([*SMALL, "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'afile' / 'run'}"],
                             env_no_launcher, capsys)
    assert out.returncode == 2
    assert "hydra.run.dir" in _one_error_line(out)


def test_unwritable_checkpoint_dir_is_refused_before_training(tmp_path):
    from megatron_hydra.launcher import run

    (tmp_path / "afile").write_text("")
    cfg = compose_config([*SMALL, "trainer.max_steps=2", f"checkpoint.dir={tmp_path / 'afile' / 'ck'}"],
                         str(tmp_path / "run"))
    with pytest.raises(ConfigError, match="checkpoint.dir=.*not a writable directory"):
        run(cfg)
    assert not (tmp_path / "run" / "csv").exists()  # refused before any step was trained


def test_more_local_cpu_workers_than_cores_allow_is_refused():
    from megatron_hydra.launcher import preflight

    cfg = compose_config([*SMALL, "trainer.devices=1000", "data.micro_batch_size=1", "data.global_batch_size=1000"])
    with pytest.raises(ConfigError, match="trainer.devices=1000 local CPU workers"):
        preflight(cfg, derive(cfg), external=None)
    ok = compose_config([*SMALL, "trainer.devices=8", "data.global_batch_size=16"])  # what the test suite itself runs on 2 cores
    preflight(ok, derive(ok), external=None)


def test_second_run_into_a_directory_in_use_is_refused(tmp_path, env_no_launcher):
    from megatron_hydra.launcher import run

    run_dir = tmp_path / "run"
    first = subprocess.Popen(launch_cmd(*SMALL, "trainer.max_steps=100000", f"hydra.run.dir={run_dir}"),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env_no_launcher)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "checkpoints").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(ConfigError, match="in use by another run"):
            run(compose_config([*SMALL, "trainer.max_steps=2"], str(run_dir)))
    finally:
        first.kill()
        first.wait()


def test_blame_goes_to_the_killed_rank_not_to_its_peer(tmp_path):
    from megatron_hydra.launcher import failure_summary, root_cause_rank

    # Rank 0 was SIGKILLed (no error file); rank 1 then lost its peer and wrote an error file.
    (tmp_path / "rank1.error").write_text("RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:1\n")
    failures = {0: SimpleNamespace(exitcode=-signal.SIGKILL), 1: SimpleNamespace(exitcode=1)}
    assert root_cause_rank(str(tmp_path), failures) == 0
    assert "killed by signal 9" in failure_summary(str(tmp_path), 0, -9)
    # A rank's own error is the cause even when its peer's report of the lost connection is older.
    (tmp_path / "rank0.error").write_text("ValueError: bad batch\n")
    failures[0] = SimpleNamespace(exitcode=1)
    assert root_cause_rank(str(tmp_path), failures) == 0


def test_failing_worker_stops_the_run_quickly_and_stale_error_files_are_not_blamed(tmp_path, env_no_launcher):
    # A sitecustomize on the workers' path makes rank 1 fail right after joining the process
    # group, while rank 0 waits for it in a collective: the launcher must not hang, and must blame
    # rank 1's own error, not the files an earlier run left in the directory.
    inject = rank1_failure_injector(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for rank in (0, 1, 3):  # left by an earlier 4-rank run in this directory
        (run_dir / f"rank{rank}.error").write_text("ValueError: EARLIER-RUN-MARKER\n")
    out = _run(launch_cmd("trainer.devices=2", *SMALL, f"hydra.run.dir={run_dir}"),
               dict(env_no_launcher, PYTHONPATH=str(inject)), timeout=180)
    ended = time.time()
    assert out.returncode == 1
    # From rank 1's failure to the launcher's exit: the 5 s grace for the other ranks' reports and
    # the agent's shutdown, not the 30 s the agent would wait, nor the collective timeout (start-up
    # is left out: it is most of the time, and it varies with the machine's load).
    after_failure = ended - (run_dir / "rank1.error").stat().st_mtime
    assert after_failure < 25, after_failure
    assert "rank 1 failed: RuntimeError: injected failure" in out.stderr
    assert (run_dir / "rank1.error").exists() and "injected failure" in (run_dir / "rank1.error").read_text()
    assert "EARLIER-RUN-MARKER" not in out.stderr and not (run_dir / "rank3.error").exists()


def test_failed_multirun_job_is_recorded_and_the_sweep_goes_on(tmp_path, env_no_launcher, capsys):
    # Job 0 is a user error (7 heads do not divide hidden size 64); job 1 must still run.
    out = _launch_in_process(["-m", *SMALL, "trainer.max_steps=2", "model.num_attention_heads=7,4",
                              f"hydra.sweep.dir={tmp_path}"], env_no_launcher, capsys)
    assert out.returncode == 1, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2, out.stderr[-3000:]
    assert errors[0].startswith(f"error: job {tmp_path / '0'} failed: ") and "num_attention_heads" in errors[0]
    assert errors[1] == f"error: 1 of 2 sweep jobs failed: {tmp_path / '0'}"
    assert "Traceback" not in out.stderr
    assert len(read_metrics(Path(tmp_path) / "1")) == 2
