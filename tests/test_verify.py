"""mode=verify (megatron_hydra.verify, docs/verify.md): the shrunk job at its layout equals one
process, resumes at another layout, and its full-size dry run is held against a GPU's memory.

- Every preset shrinks to a config that derives at its README layout, keeping tp, cp, ep, the
  GQA ratio and the schedule, within verify.max_ranks (no run: cheap, covers them all).
- gpt_tiny at tp2 passes exact and resume end to end, and writes its verdict as JSON.
- Planted bugs (tests/plants/plants.py), each only wrong at its layout, fail the exact check
  and name the first differing tensor.
- A job that does not fit fails the fit check with the plan's fixes, through launch.py --json.

The ranks are forked from the session's preloaded server (conftest.run_training's way), the
plant applied in each before it starts."""

from __future__ import annotations

import functools
import importlib.util
import json
import math
from unittest import mock

import pytest

import conftest
from conftest import compose_config, launch_py
from megatron_hydra.training import dry_run  # noqa: F401 - the stand-in GPU, registered before any backward here

PLANTS = conftest.ROOT / "tests" / "plants"

README_LAYOUTS = [
    [],
    ["trainer.devices=4"],
    ["parallel=tp2", "parallel.sequence_parallel=true", "trainer.devices=4"],
    ["parallel=pp2", "parallel.virtual_pipeline_size=2", "parallel.pipeline_schedule=interleaved_1f1b",
     "trainer.devices=2"],
    ["parallel=tp2_pp2", "trainer.devices=8", "data.global_batch_size=16"],
    ["parallel.context_parallel_size=2", "trainer.devices=2"],
    ["model=moe_tiny", "trainer.devices=2", "parallel.expert_parallel_size=2"],
    ["model=gpt_8b", "parallel=tp4_pp2"],
    ["model=gpt_175b", "parallel=tp8_pp16", "trainer=gpu", "trainer.num_nodes=128"],
    ["model=llama3.1_70b", "parallel=tp8_pp4", "trainer=gpu", "trainer.num_nodes=4"],
    ["model=mixtral_8x7b", "parallel=tp2", "parallel.expert_parallel_size=4", "trainer=gpu", "trainer.devices=8"],
    ["model=gemma2_9b", "parallel=tp4", "trainer=gpu", "trainer.devices=4"],
    ["model=qwen3_8b", "peft=lora", "parallel=tp2", "trainer.devices=2"],
    ["model=deepseek_moe_16b", "parallel.expert_parallel_size=8", "trainer=gpu", "trainer.devices=8"],
]


@pytest.mark.parametrize("overrides", README_LAYOUTS, ids=lambda o: " ".join(o) or "default")
def test_presets_shrink_at_their_layouts(overrides):
    from megatron_hydra.config import derive
    from megatron_hydra.verify.shrink import shrink

    job = compose_config(overrides, visible_gpus=0)
    d = derive(job)
    s = shrink(job, d, "unused")
    small, m = s.derived, s.cfg.model
    assert (small.tp, small.cp, small.ep, small.vpp) == (d.tp, d.cp, d.ep, d.vpp)
    assert small.world_size <= job.verify.max_ranks
    assert small.pp == d.pp or any(r.startswith("pp") for r in s.reduced)
    assert small.pp == 1 or small.pp >= 2 and d.pp >= 2
    assert small.dp == max(1 if d.dp == 1 else 2, d.ep) or any(r.startswith("dp") for r in s.reduced)
    assert all(n >= 2 for n in small.layers_per_stage)
    assert s.cfg.precision.params_dtype == "float64" and m.hidden_size <= 8 * m.num_attention_heads <= 512
    assert m.seq_length <= 64
    groups = job.model.num_query_groups or job.model.num_attention_heads
    assert m.num_attention_heads // (m.num_query_groups or m.num_attention_heads) == \
        job.model.num_attention_heads // groups
    assert (m.sliding_window is None) == (job.model.sliding_window is None)
    assert m.sliding_window is None or m.sliding_window < m.seq_length


def _planted_worker(plant, cfg, derived, rank, world, port):
    spec = importlib.util.spec_from_file_location("verify_plants", PLANTS / "plants.py")
    plants = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plants)
    if plant:
        plants.PLANTS[plant]()
    conftest._forked_worker(cfg, derived, rank, world, port)


def _verify(overrides, run_dir, plant=None):
    from megatron_hydra import launcher
    from megatron_hydra.config import derive
    from megatron_hydra.verify import run_verify

    cfg = compose_config([*overrides, "mode=verify"], str(run_dir))
    with mock.patch.object(launcher, "_spawn_local", conftest._spawn_forked), \
            mock.patch.object(conftest, "_forked_worker", functools.partial(_planted_worker, plant)):
        return run_verify(cfg, derive(cfg))


def test_tp2_passes_exact_and_resume_and_writes_json(tmp_path):
    out = tmp_path / "verdict.json"
    verdict = _verify(["parallel=tp2", "trainer.devices=2", "verify.checks=[exact,resume]",
                       f"verify.output={out}"], tmp_path)
    assert verdict.passed
    written = json.loads(out.read_text())
    assert written["passed"] and [c["name"] for c in written["checks"]] == ["exact", "resume"]
    assert all(0 <= c["largest"] < 1e-9 for c in written["checks"])
    assert "tp1 x pp1 x dp1" in written["checks"][1]["detail"]  # resumed in one process


PLANTED = [
    ("forget_tp_all_reduce", ["parallel=tp2", "trainer.devices=2"]),
    ("drop_microbatch", ["parallel=pp2", "trainer.devices=2"]),
    ("window_off_by_one", ["parallel.context_parallel_size=2", "trainer.devices=2", "model.position_embedding=rope",
                           "model.sliding_window=64"]),
    ("lora_b_wrong_dim", ["peft=lora", "parallel=tp2", "trainer.devices=2"]),
    ("optimizer_skips_a_parameter", ["optim.distributed_optimizer=true", "trainer.devices=2"]),
]


@pytest.mark.parametrize("plant,overrides", PLANTED, ids=[p for p, _ in PLANTED])
def test_planted_bug_fails_naming_the_tensor(tmp_path, plant, overrides):
    from megatron_hydra.verify import VerifyFailed

    with pytest.raises(VerifyFailed) as err:
        _verify([*overrides, "verify.checks=[exact]", "verify.steps=2"], tmp_path, plant)
    message = str(err.value)
    assert "\n" not in message and "exact (step " in message and ": tensor " in message, message


def test_job_that_does_not_fit_names_the_plans_fixes(tmp_path, env_no_launcher, capsys):
    status = launch_py(["model=gpt_125m", "mode=verify", "verify.checks=[fits]", "trainer.device_memory_gb=0.5",
                        f"hydra.run.dir={tmp_path}", "--json"], env_no_launcher)
    out, err = capsys.readouterr()
    assert status == 1
    verdict = json.loads(out)  # stdout holds the JSON alone
    fits = verdict["checks"][0]
    assert not verdict["passed"] and fits["name"] == "fits" and fits["passed"] is False
    assert "do NOT fit" in verdict["fit_table"] and "the memory plan suggests" in fits["detail"]
    assert "checks failed: fits" in err and math.isfinite(fits["seconds"])


RECOMPUTE = [  # valid at the job's size; the shrunk stage has 2 layers
    (["recompute.method=block", "recompute.num_layers=4"], 2, ["recompute.num_layers 4 -> 2"]),
    (["recompute.method=uniform", "recompute.num_layers=4"], 2, ["recompute.num_layers 4 -> 2"]),
    (["recompute.method=uniform", "recompute.num_layers=3", "parallel.layers_per_stage=[30,42]"], 2,
     ["parallel.layers_per_stage=[30, 42] -> null", "recompute.num_layers 3 -> 2"]),
    (["recompute.method=block", "recompute.num_layers=1"], 1, []),
]


@pytest.mark.parametrize("overrides,layers,notes", RECOMPUTE, ids=[" ".join(o) for o, _, _ in RECOMPUTE])
def test_recompute_layers_are_clamped_to_the_shrunk_stage(overrides, layers, notes):
    from megatron_hydra.config import derive
    from megatron_hydra.verify.shrink import shrink

    job = compose_config(["model=gpt_8b", "parallel=tp4_pp2", "recompute.granularity=full", *overrides])
    s = shrink(job, derive(job), "unused")
    assert s.cfg.recompute.num_layers == layers and s.derived.layers_per_stage == (2, 2)
    assert s.cfg.recompute.method == job.recompute.method and s.cfg.recompute.granularity == "full"
    for note in notes:
        assert any(r.startswith(note) for r in s.reduced), (note, s.reduced)
    assert not notes or len([r for r in s.reduced if r.startswith(("recompute", "parallel"))]) == len(notes)


def test_a_nan_loss_fails_the_check():
    from megatron_hydra.verify import _compared
    from megatron_hydra.verify.compare import compare_metrics

    ref = {1: {"loss": 2.0, "grad_norm": 1.0}}
    diff = compare_metrics({1: {"loss": math.nan, "grad_norm": 1.0}}, ref, [1], 1e-9)
    assert math.isnan(diff.largest) and "loss nan vs 2.0" in diff.first
    assert _compared(diff, 1e-9, "compared").passed is False
    assert _compared(compare_metrics(ref, ref, [1], 1e-9), 1e-9, "compared").passed


def test_fits_alone_does_not_shrink_a_transformer_engine_job(tmp_path):
    """verify.checks=[fits] runs the full-size job's dry run, which swaps in the local layers
    itself: shrinking (which refuses Transformer Engine) is for exact and resume only."""
    from megatron_hydra import verify
    from megatron_hydra.config import derive
    from megatron_hydra.verify.report import Check

    cfg = compose_config(["model.transformer_impl=transformer_engine", "trainer=gpu", "mode=verify",
                          "verify.checks=[fits]"], str(tmp_path))
    with mock.patch.object(verify, "_fits", lambda verdict, job: Check("", True, None, detail="fits")):
        verdict = verify._run_checks(cfg, derive(cfg), str(tmp_path / "verify"))
    assert verdict.passed and [c.name for c in verdict.checks] == ["fits"] and verdict.reduced == []
