"""One migration: a command line (or a script's) -> the translation, launch.py's overrides, the model
YAML when the model is no preset, the composed config and derive's verdict on it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from megatron_hydra.config import RunConfig
from megatron_hydra.errors import ConfigError
from megatron_hydra.migrate.check import check_composed, compose, validate
from megatron_hydra.migrate.command_line import parse
from megatron_hydra.migrate.presets import ModelChoice, choose_model, model_yaml, overrides
from megatron_hydra.migrate.report import Lines, classify, render
from megatron_hydra.migrate.shell import MAX_SCRIPT_BYTES, read_script
from megatron_hydra.migrate.translate import translate
from megatron_hydra.migrate.translation import Translation
from megatron_hydra.untrusted import read_text


@dataclass
class Migration:
    translation: Translation
    model: ModelChoice
    overrides: List[str]
    lines: Lines
    config: Optional[RunConfig]  # None when the overrides do not compose
    problem: Optional[str]  # why the result cannot run (Hydra's or derive's one line), None when it can
    unresolved: List[str] = field(default_factory=list)
    yaml_text: Optional[str] = None
    yaml_path: Optional[str] = None

    def report(self) -> str:
        return render(self.translation, self.overrides, self.lines, self.unresolved, self.yaml_text,
                      self.yaml_path, self.model.nearest_notes)


def migrate(argv: Sequence[str] = (), file: Optional[str] = None, name: Optional[str] = None,
            output: Optional[str] = None) -> Migration:
    """Translate ``argv`` (after the flags of ``file``, a script or a list of flags, when given)."""
    words, unresolved = [], []
    if file is not None:
        script = read_script(read_text(file, MAX_SCRIPT_BYTES, "script", ConfigError), file)
        words, unresolved = list(script.argv), list(script.unresolved)
    words += list(argv)
    if not words:
        raise ConfigError("no Megatron-LM command line: give it after --, or a script with --file")
    if name is not None and not name.replace("_", "").replace(".", "").replace("-", "").isalnum():
        raise ConfigError(f"--name {name!r}: use letters, digits, '.', '-' and '_' (it names conf/model/<name>.yaml)")
    t = translate(parse(words))
    choice = choose_model(t, name)
    yaml_text = yaml_path = None
    if choice.preset is None:
        yaml_text = model_yaml(choice)
        if output is not None:
            yaml_path = os.path.join(output, "model", f"{choice.name}.yaml")
            try:
                os.makedirs(os.path.dirname(yaml_path), exist_ok=True)
                with open(yaml_path, "w") as f:
                    f.write(yaml_text)
            except OSError as e:
                raise ConfigError(f"--output {output}: cannot write {yaml_path} ({e.strerror or e}): give a "
                                  "writable directory") from None
    args = overrides(t, choice, output if yaml_path else None)
    try:
        cfg = compose(args)
    except ConfigError as e:
        cfg, problem = None, str(e)
    else:
        problem = check_composed(t, cfg) or validate(cfg)
    return Migration(t, choice, args, classify(t), cfg, problem, unresolved, yaml_text, yaml_path)
