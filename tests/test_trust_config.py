"""A checkpoint's config is data: ``model=from_checkpoint`` reads a checkpoint's model without ever
putting the checkpoint on Hydra's search path, and a stored config (meta.json, the workers'
resolved_config.yaml) can hold no alias bomb, tag, Hydra key or live interpolation."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import yaml

from conftest import SMALL, launch_py, read_metrics
from megatron_hydra.checkpoint.model_source import model_config
from megatron_hydra.config.io import from_yaml, to_yaml
from megatron_hydra.config.schema import RunConfig
from megatron_hydra.errors import ConfigError

PLANTED = """# @package _global_
hydra:
  callbacks:
    planted:
      _target_: pathlib.Path.write_text
      self: {target}
      data: written by a checkpoint's config file
"""


def _stored_config(ckpt, text: str) -> None:
    """Replace the config text in ``ckpt``'s meta.json (meta.json itself carries no checksum)."""
    meta_file = ckpt / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["config"] = text
    meta_file.write_text(json.dumps(meta))


def _copy(small_checkpoint, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(small_checkpoint, ckpt)
    return ckpt


def test_model_from_checkpoint_trains_its_model_and_never_reads_its_config_files(small_checkpoint, tmp_path,
                                                                                 env_no_launcher):
    """The fine-tune command's model comes from meta.json; a Hydra config planted in the checkpoint
    directory (what ``--config-dir <checkpoint>`` used to load) is never composed."""
    ckpt = _copy(small_checkpoint, tmp_path)
    target = tmp_path / "planted.txt"
    for name in ("model/small.yaml", "model/from_checkpoint.yaml", "config.yaml"):
        (ckpt / name).parent.mkdir(exist_ok=True)
        (ckpt / name).write_text(PLANTED.format(target=target))
    run_dir = tmp_path / "run"
    small_without_model = [o for o in SMALL if not o.startswith("model.")]
    code = launch_py(["model=from_checkpoint", f"checkpoint.load={ckpt}", "checkpoint.load_optimizer=false",
                      "model.hidden_dropout=0.1", *small_without_model, "trainer.max_steps=3", f"hydra.run.dir={run_dir}"],
                     env_no_launcher)
    assert code == 0
    assert not target.exists()
    ran = yaml.safe_load((run_dir / "resolved_config.yaml").read_text())
    stored = yaml.safe_load(json.loads((ckpt / "meta.json").read_text())["config"])
    assert ran["model"] == {**stored["model"], "hidden_dropout": 0.1}  # the checkpoint's model, the override on top
    assert all(row["loss"] < 7 for row in read_metrics(run_dir))  # the 2-step checkpoint's weights, ln(500) = 6.2
    assert (run_dir / "checkpoints" / "step_0000003" / "COMPLETE").is_file()


def test_model_from_checkpoint_applies_overrides_and_checks_types(small_checkpoint):
    model = model_config(str(small_checkpoint), [("num_layers", 2), ("rope_theta", 5e5)])
    assert (model.num_layers, model.hidden_size, model.rope_theta) == (2, 64, 5e5)
    with pytest.raises(ConfigError, match="model.num_layers"):
        model_config(str(small_checkpoint), [("num_layers", "many")])
    with pytest.raises(ConfigError, match="checkpoint.load"):
        model_config(None)


@pytest.mark.parametrize("planted, named", [
    ("hydra:\n  callbacks:\n    x: {_target_: pathlib.Path.write_text}\n", "hydra"),
    ("model:\n  _target_: os.system\n", "model._target_"),
    ("defaults:\n  - override model: gpt_8b\n", "defaults"),
])
def test_a_stored_config_with_hydra_keys_is_refused(small_checkpoint, tmp_path, planted, named):
    ckpt = _copy(small_checkpoint, tmp_path)
    _stored_config(ckpt, planted)
    with pytest.raises(ConfigError, match=f"holds the key {named}") as err:
        model_config(str(ckpt))
    assert "\n" not in str(err.value)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("text, says", [
    # An alias bomb: nine levels of nine-fold aliases expand to 387M strings.
    ("a0: &a0 [x,x,x,x,x,x,x,x,x]\n" + "".join(f"a{i}: &a{i} [{','.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 10)),
     "anchors"),
    ("model: !!python/object/apply:os.system ['true']\n", "python/object/apply"),
    ("model: " + "[" * 100_000 + "]" * 100_000 + "\n", "nested deeper"),
    ("- a\n- b\n", "not a mapping"),
    ("model: {num_layers: 2\n", "not plain YAML"),
])
def test_crafted_stored_configs_are_one_line_errors_at_once(text, says):
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=says) as err:
        from_yaml(text, "ckpt/meta.json")
    assert time.perf_counter() - start < 5
    assert "\n" not in str(err.value) and "ckpt/meta.json" in str(err.value)


def test_interpolations_in_a_stored_config_stay_text():
    """Interpolations were resolved before a config was stored: one found there is text to keep,
    never a resolver to run (``${oc.env:...}``) or a key to look up (``${nope}`` used to raise)."""
    cfg = RunConfig(run_dir="runs/a")
    cfg.model.name = "${nope}"
    cfg.data.path = "C:\\data\\${oc.env:HOME}\\\\${x}"
    back = from_yaml(to_yaml(cfg), "resolved_config.yaml")
    assert back == cfg


def test_an_unresolvable_interpolation_on_the_command_line_is_one_line(tmp_path, env_no_launcher, capsys):
    code = launch_py(["model.name=${nope}", "mode=plan", f"hydra.run.dir={tmp_path}"], env_no_launcher)
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().splitlines() == [
        "error: model.name: Interpolation key 'nope' not found: fix that value on the command line or in its "
        "config file"]


def test_model_from_checkpoint_needs_a_checkpoint(tmp_path, env_no_launcher, capsys):
    code = launch_py(["model=from_checkpoint", "mode=plan", f"hydra.run.dir={tmp_path}"], env_no_launcher)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "checkpoint.load" in err[0]

