"""Every ``launch.py`` command the documentation shows composes and passes ``derive``.

Commands are read from the code blocks of README.md and docs/*.md (backslash-continued lines
joined; ``torchrun ... launch.py ...`` and ``srun ... launch.py ...`` included), from inline code
spans of their prose that hold a command with overrides, and from the
Dockerfile (its usage comment and CMD). Each is composed with Hydra from ``conf/`` as launch.py
would, its ``auto`` values resolved as on the machine it is meant for (8 visible GPUs when it says
``trainer=gpu`` or comes from the GPU image's Dockerfile, else this CPU machine; under torchrun/srun the ranks per node they start), then
derived. A sweep (``-m a=1,2 b=x,y``) is checked in every combination; ``hydra/launcher`` and
``hydra/sweeper`` choices and their ``hydra.launcher.*``/``hydra.sweeper.*`` keys are dropped
(plugins that need a cluster), so is a bare ``...`` ("more overrides"). Files a command names
(``data.blend``, ``checkpoint.load``) need not exist: derive reads none. ``model=from_checkpoint``
with ``checkpoint.load=ckpt/<family>`` gets the model an import of that family holds, from a small
config of that family.

Commands the text shows failing on purpose are listed in ``INTENDED_ERRORS`` with the key their
error must name; anything else that fails here is a documentation bug.
"""

from __future__ import annotations

import itertools
import re
import shlex
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from conftest import CONF, ROOT
from megatron_hydra.config import derive, register_configs
from megatron_hydra.config.machine import resolve
from megatron_hydra.errors import ConfigError

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GPUS_OF_A_GPU_NODE = 8

# (a fragment of the command, the key its one-line error names, why the docs show it failing)
INTENDED_ERRORS = [
    ("launch.py model.num_attention_heads=7", "model.num_attention_heads",
     "README, 'What happens on launch': the example of a one-line config error"),
]

# Small configs of each family: the model ``model=from_checkpoint`` reads from an import at ``ckpt/<family>``.
HF_CONFIGS = {
    "gpt2": ("gpt2", dict(n_embd=64, n_layer=4, n_head=4, n_positions=128, vocab_size=512)),
    "llama": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=512, max_position_embeddings=128)),
    "bert": ("bert", dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                          intermediate_size=128, max_position_embeddings=128)),
    "t5": ("t5", dict(vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4)),
}


def _code_lines(text: str) -> Iterator[str]:
    """Lines inside fenced code blocks, continuations joined."""
    inside, pending = False, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside, pending = not inside, ""
            continue
        if not inside:
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield pending + line
        pending = ""


def _inline_commands(text: str) -> Iterator[str]:
    """Commands in inline code spans of the prose (```python launch.py model=... ...```)."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    yield from re.findall(r"`((?:python|torchrun|srun)\b[^`]*launch\.py\s[^`]+)`", prose.replace("\n", " "))


def _dockerfile_lines(text: str) -> Iterator[str]:
    joined = re.sub(r"\\\n#?\s*", " ", text)
    for line in joined.splitlines():
        if line.startswith("CMD ["):
            yield " ".join(re.findall(r'"([^"]*)"', line))
        elif line.startswith("#") and "python launch.py" in line:
            yield line.lstrip("# ")


def documented_commands() -> List[Tuple[str, str]]:
    """(where, command) for every launch.py command line of the docs."""
    found = []
    for path in DOCS:
        text = path.read_text()
        for line in [*_code_lines(text), *_inline_commands(text)]:
            if re.search(r"(^|\s|/)launch\.py(\s|$)", line) and ("python" in line or "torchrun" in line or "srun" in line):
                found.append((path.name, line.strip()))
    for line in _dockerfile_lines((ROOT / "Dockerfile").read_text()):
        found.append(("Dockerfile", line.strip()))
    return found


class Command:
    """A launch.py command line: Hydra's options, its overrides, and the ranks per node an external
    launcher gives it."""

    def __init__(self, line: str):
        tokens = shlex.split(line, comments=True)
        at = next(i for i, t in enumerate(tokens) if t.endswith("launch.py"))
        launcher, args = tokens[:at], tokens[at + 1:]
        self.local_ranks = _option(launcher, "--nproc-per-node", "--nproc_per_node", "--ntasks-per-node")
        self.config_dir: Optional[str] = None
        self.overrides: List[str] = []
        i = 0
        while i < len(args):
            arg = args[i]
            if arg in ("--config-dir", "-cd"):
                self.config_dir, i = args[i + 1], i + 2
                continue
            i += 1
            if arg in ("-m", "--multirun", "...") or arg.startswith(("hydra/launcher=", "hydra/sweeper=",
                                                                         "hydra.launcher.", "hydra.sweeper.")):
                continue
            self.overrides.append(arg)
        self.gpu = any(o in ("trainer=gpu", "trainer.accelerator=gpu") for o in self.overrides)

    def combinations(self) -> List[List[str]]:
        """Every job of a sweep (the overrides themselves when there is none)."""
        choices = []
        for override in OverridesParser.create().parse_overrides(self.overrides):
            key = override.get_key_element()
            if override.is_sweep_override():
                choices.append([f"{key}={v}" for v in override.sweep_string_iterator()])
            else:
                choices.append([override.input_line])
        return [list(c) for c in itertools.product(*choices)]


def _option(tokens: List[str], *names: str) -> Optional[int]:
    for i, token in enumerate(tokens):
        for name in names:
            if token == name:
                return int(tokens[i + 1])
            if token.startswith(name + "="):
                return int(token.split("=", 1)[1])
    return None


def _imported_model(composed, overrides: List[str]) -> None:
    """``model=from_checkpoint`` with ``checkpoint.load=ckpt/<family>``: the model an import of that
    family holds, with the command's ``model.*`` overrides on top, as launch.py does."""
    from megatron_hydra.convert import families
    from megatron_hydra.convert.mapping import HFConfig

    name = Path(composed.checkpoint.load).name
    kind, hf = HF_CONFIGS[next(k for k in HF_CONFIGS if name.startswith(k))]
    model = OmegaConf.structured(families.FAMILIES[kind].model_config(HFConfig(hf, "config.json"), name))
    for override in OverridesParser.create().parse_overrides(overrides):
        if override.key_or_group.startswith("model."):
            OmegaConf.update(model, override.key_or_group[len("model."):], override.value(), merge=True)
    composed.model = model


def derive_command(line: str, tmp_path: Path, gpu_machine: bool = False) -> None:
    """Compose and derive ``line``; ``gpu_machine``: it runs where GPUs are (the Docker image)."""
    command = Command(line)
    command.gpu = command.gpu or gpu_machine
    register_configs()
    config_dir = str(CONF)
    for overrides in command.combinations():
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            composed = compose(config_name="config", overrides=["run_dir=unused", *overrides])
        if composed.model.name == "from_checkpoint":
            _imported_model(composed, overrides)
        cfg = resolve(OmegaConf.to_object(composed), GPUS_OF_A_GPU_NODE if command.gpu else 0, command.local_ranks)
        if cfg.mode == "plan_layouts":  # plans for cfg.cluster; launcher.run asks for the batch
            assert cfg.cluster is not None and cfg.data.global_batch_size is not None, overrides
            continue
        derive(cfg)


COMMANDS = documented_commands()


def test_the_docs_show_launch_commands_of_every_kind():
    lines = [line for _, line in COMMANDS]
    assert len(lines) > 40
    assert any(line.startswith("torchrun") for line in lines) and any(" -m " in line for line in lines)
    assert any("model=from_checkpoint" in line for line in lines) and any("trainer=gpu" in line for line in lines)
    for fragment, _, _ in INTENDED_ERRORS:
        assert any(fragment in line for line in lines), f"{fragment!r} is no longer in the docs: drop it here"


@pytest.mark.parametrize("where,line", COMMANDS, ids=[f"{w}:{l[:60]}" for w, l in COMMANDS])
def test_documented_command_derives(where, line, tmp_path):
    expected = [(key, why) for fragment, key, why in INTENDED_ERRORS if fragment in line]
    if expected:
        key, why = expected[0]
        with pytest.raises(ConfigError, match=re.escape(key)) as info:
            derive_command(line, tmp_path)
        assert "\n" not in str(info.value), why
        return
    derive_command(line, tmp_path, gpu_machine=where == "Dockerfile")
