"""The package imports downward only, with no cycles; Lightning is training/'s alone, and the
launcher runs without it.

The allowed direction is written once, here: a module may import from its own package and from
packages of a lower level. Function-level imports count too (they are imports all the same).
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_hydra"

LEVELS = {
    "errors": 0,
    "untrusted": 1,  # reading files from elsewhere (bounded, regular files only)
    "config": 2, "slurm": 2, "lifecycle": 2,  # pure data and process/environment helpers
    "parallel": 3,
    "models": 4,
    "data": 5,
    "checkpoint": 6, "planning": 6,
    "convert": 7, "report": 7, "inference": 7,  # inference: the engine and lm-eval adapter, any layout
    "training": 8,
    "launcher": 9,
    "generate": 10, "evaluate": 10, "migrate": 10,  # command lines (the first two start jobs through the launcher)
    "verify": 10,  # mode=verify: the job shrunk and run through the launcher, its dry run, the verdict
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.lru_cache(maxsize=None)
def _import_nodes(path: Path) -> tuple:
    """Every import statement of ``path``, anywhere in the file (parsed once for all the tests)."""
    return tuple(node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, (ast.Import, ast.ImportFrom)))


def _imports(path: Path):
    """The megatron_hydra modules that ``path`` imports, anywhere in the file."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in _import_nodes(path):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("megatron_hydra"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.startswith("megatron_hydra"):
                yield base


def _external_imports(path: Path):
    for node in _import_nodes(path):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            yield node.module


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _graph():
    graph = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        graph[_module_name(path)].update(m for m in _imports(path) if m != _module_name(path))
    return graph


def test_every_package_has_a_level():
    units = {_unit(m) for m in _graph()} - {""}
    assert units <= set(LEVELS), f"give these a level in LEVELS: {sorted(units - set(LEVELS))}"


def test_imports_go_downward_only():
    upward = []
    for module, targets in _graph().items():
        src = _unit(module)
        for target in targets:
            dst = _unit(target)
            if src and dst and src != dst and LEVELS[dst] >= LEVELS[src]:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that go up or sideways:\n" + "\n".join(sorted(upward))


def test_only_training_imports_lightning():
    """Model, parallel, data and checkpoint code knows nothing of Lightning."""
    outside = [f"{_module_name(path)} -> {name}" for path in PACKAGE.rglob("*.py")
               for name in _external_imports(path)
               if name.split(".")[0] in ("pytorch_lightning", "lightning") and _unit(_module_name(path)) != "training"]
    assert not outside, "Lightning imported outside training/:\n" + "\n".join(sorted(outside))


def test_no_import_cycles():
    graph = _graph()
    nodes = {m for m in graph} | {t for ts in graph.values() for t in ts}
    # Tarjan's strongly connected components; any with more than one module is a cycle.
    index, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    # Importing a package runs its __init__, so a submodule importing its own package is no cycle.
    cycles = [c for c in cycles if not all(m == min(c, key=len) or m.startswith(min(c, key=len) + ".") for m in c)]
    assert not cycles, f"import cycles: {cycles}"


def test_the_launcher_path_never_imports_lightning(tmp_path):
    """Validation, the memory plan and the checkpoint start point run in the launching process
    before any worker exists: none of that may pull in Lightning."""
    code = (
        "import sys\n"
        "import megatron_hydra.launcher, megatron_hydra.checkpoint.plan, megatron_hydra.planning.fit\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('pytorch_lightning', 'lightning'))\n"
        "print(' '.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"Lightning imported by the launcher path: {out}"
