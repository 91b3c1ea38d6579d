"""A Megatron-LM command line split into its launcher, its script and its flags, as argparse reads
them: ``--flag value`` or ``--flag=value``, switches without a value, list flags taking every value
up to the next flag, the last of a repeated flag winning.

The launcher decides the world: ``torchrun`` / ``python -m torch.distributed.launch|run`` with
``--nproc-per-node`` (or ``--nproc_per_node``) and ``--nnodes``, ``srun`` with
``--ntasks-per-node``, ``--nodes`` and ``--ntasks``, ``deepspeed`` with ``--num_gpus`` and
``--num_nodes``, ``accelerate launch`` with ``--num_processes`` and ``--num_machines``, ``mpirun``
with ``-np`` / ``-n`` (every process) and ``-N`` / ``--npernode`` / ``-ppn`` (per node); a plain
``python pretrain_gpt.py`` is one process. A count of every process with neither a per-node nor a
node count is taken as one node's, said in a note.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from megatron_hydra.migrate import flags

LAUNCH_MODULES = ("torch.distributed.launch", "torch.distributed.run")
# launcher option -> what it counts: the processes per node (devices), the nodes, or every process (world)
WORLD_OPTIONS = {
    "--nproc-per-node": "devices", "--nproc_per_node": "devices", "--ntasks-per-node": "devices",
    "--num_gpus": "devices", "--num-gpus": "devices", "--gpus-per-node": "devices",
    "--nnodes": "nodes", "--nodes": "nodes", "-N": "nodes", "--num_nodes": "nodes", "--num-nodes": "nodes",
    "--num_machines": "nodes", "--num-machines": "nodes",
    "--ntasks": "world", "-n": "world", "--num_processes": "world", "--num-processes": "world",
}
MPI_LAUNCHERS = ("mpirun", "mpiexec")
MPI_OPTIONS = {  # Open MPI's and MPICH's (-N is per node here, not srun's node count)
    "-np": "world", "-n": "world", "--np": "world", "--n": "world", "-c": "world",
    "-N": "devices", "--npernode": "devices", "-npernode": "devices", "-ppn": "devices", "--ppn": "devices",
}
LAUNCHER_SWITCHES = ("--standalone", "--use_env", "--use-env", "--no_python", "--no-python", "--run_path",
                     "--run-path", "--module", "-m")


@dataclass
class CommandLine:
    launcher: str  # "torchrun", "python", ... ("" for bare flags)
    devices: Union[int, str, None]  # ranks per node (None: not given)
    num_nodes: Optional[int]
    world_flags: Dict[str, str]  # the launcher options that gave devices / num_nodes
    script: Optional[str]
    raw: Dict[str, List[str]] = field(default_factory=dict)  # every flag given -> its value words
    counted: Dict[str, Tuple[str, ...]] = field(default_factory=dict)  # devices / nodes -> the options behind it
    values: Dict[str, Any] = field(default_factory=dict)  # translated flags -> typed value
    order: List[str] = field(default_factory=list)
    stray: List[str] = field(default_factory=list)  # words that belong to no flag
    repeated: List[str] = field(default_factory=list)
    bad: List[Tuple[str, str, str]] = field(default_factory=list)  # (flag, value, why)
    notes: List[str] = field(default_factory=list)

    def given(self, flag: str) -> bool:
        return flag in self.values

    def get(self, flag: str) -> Any:
        """The flag's value, or Megatron-LM's default when it is absent (None: no default)."""
        if flag in self.values:
            return self.values[flag]
        if flags.TRANSLATED.get(flag, ("", None))[1] is bool:
            return False
        return flags.DEFAULTS.get(flag)

    def shown(self, flag: str) -> str:
        """The flag as given, for the report."""
        return " ".join([flag, *self.raw.get(flag, [])])


def parse(argv: Sequence[str]) -> CommandLine:
    """Split ``argv`` (with or without a launcher in front) into a ``CommandLine``."""
    argv = list(argv)
    cl, start = _launcher(argv)
    _flags(cl, argv[start:])
    return cl


def _launcher(argv: List[str]) -> Tuple[CommandLine, int]:
    if not argv or argv[0].startswith("-"):
        return CommandLine("", None, None, {}, None), 0
    head = argv[0].rsplit("/", 1)[-1]
    i = 1
    if re.fullmatch(r"python[0-9.]*", head):
        if argv[1:2] == ["-m"] and argv[2:3] and argv[2] in LAUNCH_MODULES:
            head, i = f"python -m {argv[2]}", 3
        elif argv[1:2] and argv[1].endswith(".py"):
            return CommandLine("python", 1, 1, {}, argv[1]), 2
    if head.endswith(".py"):
        return CommandLine("python", 1, 1, {}, argv[0]), 1
    options: Dict[str, str] = {}
    while i < len(argv) and not argv[i].endswith(".py"):
        word = argv[i]
        name, eq, value = word.partition("=")
        if eq:
            options[name] = value
        elif name.startswith("-") and name not in LAUNCHER_SWITCHES and i + 1 < len(argv) \
                and not argv[i + 1].startswith("-") and not argv[i + 1].endswith(".py"):
            options[name] = argv[i + 1]
            i += 1
        i += 1
    script = argv[i] if i < len(argv) else None
    cl = CommandLine(head, None, None, {}, script)
    table = MPI_OPTIONS if head in MPI_LAUNCHERS else WORLD_OPTIONS
    counts: Dict[str, Tuple[int, str]] = {}  # what -> (count, option)
    for name, value in options.items():
        what = table.get(name)
        if what is None:
            continue
        cl.world_flags[name] = value
        if what == "devices" and value in ("gpu", "auto"):
            cl.devices = "auto"
            cl.counted["devices"] = (name,)
        elif re.fullmatch(r"\d+", value) and int(value) > 0:
            counts[what] = (int(value), name)
        else:
            cl.notes.append(f"{name} {value}: not a fixed count (an elastic range?): give trainer.devices / "
                            "trainer.num_nodes yourself")
    _world(cl, counts)
    if cl.devices is None and head.startswith(("torchrun", "python")):
        cl.devices = 1  # torchrun's default: one process per node
    if cl.num_nodes is None and cl.devices is not None:
        cl.num_nodes = 1
    return cl, i + 1


def _world(cl: CommandLine, counts: Dict[str, Tuple[int, str]]) -> None:
    """Devices per node and nodes from the launcher's counts; a count of every process fills in
    the one of them that is missing (both missing: one node)."""
    for what, attr in (("devices", "devices"), ("nodes", "num_nodes")):
        if what in counts:
            setattr(cl, attr, counts[what][0])
            cl.counted[what] = (counts[what][1],)
    if "world" not in counts:
        return
    world, flag = counts["world"]
    if cl.devices == "auto" or (cl.devices is not None and cl.num_nodes is not None):
        return
    if cl.devices is None and cl.num_nodes is None:
        cl.devices, cl.num_nodes = world, 1
        cl.counted = {"devices": (flag,), "nodes": ()}
        cl.notes.append(f"{flag} {world} counts every process: taken as {world} on one node; set trainer.devices "
                        "(per node) and trainer.num_nodes for the real split")
        return
    known, missing = ("devices", "nodes") if cl.devices is not None else ("nodes", "devices")
    per = cl.devices if known == "devices" else cl.num_nodes
    if world % per:
        cl.notes.append(f"{flag} {world} is not a multiple of {counts[known][1]} {per}: give trainer.devices and "
                        "trainer.num_nodes yourself")
        return
    setattr(cl, "num_nodes" if missing == "nodes" else "devices", world // per)
    cl.counted[missing] = (flag, counts[known][1])


def _flags(cl: CommandLine, argv: List[str]) -> None:
    i = 0
    while i < len(argv):
        word = argv[i]
        if not word.startswith("--"):
            cl.stray.append(word)
            i += 1
            continue
        name, eq, inline = word.partition("=")
        arity = flags.arity(name)
        if eq:
            values, i = [inline], i + 1
        elif arity == "0":
            values, i = [], i + 1
        else:
            j = i + 1
            while j < len(argv) and not argv[j].startswith("--") and (arity == "*" or j == i + 1):
                j += 1
            values, i = argv[i + 1:j], j
        if name in cl.raw:
            cl.repeated.append(name)
            cl.order.remove(name)
        cl.raw[name] = values
        cl.order.append(name)
        if name in flags.TRANSLATED:
            _typed(cl, name, values)


def _typed(cl: CommandLine, name: str, values: List[str]) -> None:
    arity, kind = flags.TRANSLATED[name]
    cl.values.pop(name, None)
    if arity == "0":
        if values:
            cl.bad.append((name, values[0], "a switch takes no value"))
            return
        cl.values[name] = True
    elif arity == "*":
        cl.values[name] = list(values)
    elif not values:
        cl.bad.append((name, "", "needs a value"))
    else:
        try:
            cl.values[name] = kind(values[0])
        except ValueError:
            cl.bad.append((name, values[0], f"is not {'an integer' if kind is int else 'a number'}"))
