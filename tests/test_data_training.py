"""Training on Megatron .bin/.idx data through the launch path: blend, splits, validation."""

from __future__ import annotations

import json
import math

import pytest

from conftest import SMALL, launch_py, run_training
from megatron_hydra.data import preprocess as pp

MODEL = [o for o in SMALL if not o.startswith("data=")]


def _corpus(tmp_path, name, text, docs=40):
    src = tmp_path / f"{name}.jsonl"
    src.write_text("".join(json.dumps({"text": f"{text} number {i}. " * 5}) + "\n" for i in range(docs)))
    cfg = pp.parse_args([f"input={src}", f"output_prefix={tmp_path / name}", "progress=false"])
    return pp.preprocess(cfg)["text"]


def test_blend_with_validation_logs_val_loss_and_ppl(tmp_path):
    a, b = _corpus(tmp_path, "a", "alpha beta"), _corpus(tmp_path, "b", "gamma delta")
    rows = run_training([*MODEL, "data=indexed", f"data.blend=[0.3,{a},0.7,{b}]", "data.split=[80,20,0]",
                         "trainer.max_steps=4", "trainer.val_check_interval=2", "trainer.limit_val_batches=2",
                         "trainer.devices=2", "checkpoint.save_last=false"], tmp_path / "run")  # no checkpoint read
    val = [r for r in rows if "val_loss" in r]
    assert len(val) == 2  # after steps 2 and 4
    for r in val:
        assert r["val_ppl"] == pytest.approx(math.exp(r["val_loss"]), rel=1e-5)
    train = [r for r in rows if "loss" in r]
    assert len(train) == 4 and train[-1]["loss"] < train[0]["loss"]


def test_bad_blend_fails_before_workers_start(tmp_path, env_no_launcher, capfd):
    code = launch_py([*MODEL, "data=indexed", f"data.blend=[{tmp_path / 'missing_text_document'}]",
                      "trainer.devices=2", f"hydra.run.dir={tmp_path / 'run'}"], env_no_launcher)
    err = capfd.readouterr().err
    assert code == 2
    assert "missing_text_document" in err and "Traceback" not in err
    assert not list((tmp_path / "run").glob("rank*.error"))  # no worker ever started


def test_split_accepts_list_and_string():
    from megatron_hydra.data.builders import parse_split

    assert parse_split([969, 30, 1]) == parse_split("969,30,1") == pytest.approx([0.969, 0.03, 0.001])
