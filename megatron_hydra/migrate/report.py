"""What a translation prints: the launch.py command, then every flag of the command line on one
line each (its keys, or why it needs none, or why it has no equivalent, or that it is unknown),
Megatron-LM defaults written out, what a script left unknown, and notes."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from megatron_hydra.migrate import flags
from megatron_hydra.migrate.values import hydra_value, shell_word
from megatron_hydra.migrate.translation import Translation

WIDTH = 40  # the flag column


@dataclass
class Lines:
    """Each flag of the command line in its section: (flag as given, what became of it)."""

    translated: List[Tuple[str, str]] = field(default_factory=list)
    same: List[Tuple[str, str]] = field(default_factory=list)
    none: List[Tuple[str, str]] = field(default_factory=list)
    unknown: List[Tuple[str, str]] = field(default_factory=list)

    def counts(self) -> Dict[str, int]:
        return {"translated": len(self.translated), "no key needed": len(self.same),
                "no equivalent": len(self.none), "unknown": len(self.unknown)}


def classify(t: Translation) -> Lines:
    cl, used = t.cl, t.used()
    refused = {flag: why for flag, _, why in t.refused if flag in cl.raw}
    out = Lines()
    for flag in cl.order:
        shown = cl.shown(flag)
        if flag in refused:
            out.none.append((shown, refused[flag]))
        elif flag in used:
            out.translated.append((shown, " ".join(used[flag])))
        elif flag in t.ignored:
            out.same.append((shown, t.ignored[flag]))
        elif flag in flags.SAME:
            out.same.append((shown, flags.SAME[flag][1]))
        elif flag in flags.NO_EQUIVALENT:
            out.none.append((shown, flags.NO_EQUIVALENT[flag][1]))
        elif flag in flags.TRANSLATED:
            out.same.append((shown, "no effect with the other flags given"))
        else:
            out.unknown.append((shown, _unknown(flag)))
    for word in cl.stray:
        out.unknown.append((word, "a value without a flag"))
    return out


def _unknown(flag: str) -> str:
    names = list(flags.TRANSLATED) + list(flags.SAME) + list(flags.NO_EQUIVALENT)
    close = difflib.get_close_matches(flag.replace("_", "-"), names, n=1, cutoff=0.8)
    hint = f": did you mean {close[0]}?" if close else ""
    return f"not in this tool's table (misspelled, or newer than it){hint}"


def render(t: Translation, overrides: List[str], lines: Lines, unresolved: List[str], yaml_text: Optional[str],
           yaml_path: Optional[str], notes: List[str]) -> str:
    cl = t.cl
    counts = ", ".join(f"{n} {what}" for what, n in lines.counts().items())
    out = [f"# {cl.script or 'flags'}: {len(cl.order)} flags ({counts})"]
    out += [f"{command}" for command in t.before]
    out.append(_command(overrides))
    if cl.world_flags:
        launched = " ".join(f"{k} {v}" for k, v in cl.world_flags.items())
        devices, nodes = hydra_value(t.keys["trainer.devices"]), t.keys["trainer.num_nodes"]
        out.append(f"\nlauncher ({cl.launcher}): {launched} -> trainer.devices={devices} trainer.num_nodes={nodes}")
    for title, rows in (("translated", lines.translated), ("no key needed", lines.same),
                        ("no equivalent", lines.none), ("unknown", lines.unknown)):
        if rows:
            out.append(f"\n{title} ({len(rows)}):")
            out += [_row(flag, what) for flag, what in rows]
    defaults = [k for k in t.defaults() if f"{k}={hydra_value(t.keys[k])}" in overrides]
    if defaults:
        out.append("\nMegatron-LM's defaults where they differ from ours, written out:")
        out.append("  " + " ".join(f"{k}={hydra_value(t.keys[k])}" for k in defaults))
    if unresolved:
        out.append(f"\nnot known without running the script ({len(unresolved)}):")
        out += [f"  {line}" for line in unresolved]
    missing = [(flag, why) for flag, _, why in t.refused if flag not in cl.raw]
    all_notes = [f"{flag}: {why}" for flag, why in missing] + t.notes + cl.notes + notes
    all_notes += [f"{flag} is given more than once: the last one counts, as in Megatron-LM" for flag in cl.repeated]
    if all_notes:
        out.append("\nnotes:")
        out += [f"  {note}" for note in all_notes]
    if yaml_text is not None:
        where = f"written to {yaml_path}" if yaml_path else "not a preset; save it to use model=<name>"
        out.append(f"\nmodel YAML ({where}):")
        out += ["  " + line for line in yaml_text.rstrip().splitlines()]
    return "\n".join(out)


def _row(flag: str, what: str) -> str:
    return f"  {flag:<{WIDTH}} {what}" if len(flag) < WIDTH else f"  {flag}\n  {'':<{WIDTH}} {what}"


def _command(overrides: List[str]) -> str:
    """``python launch.py`` and the overrides, a few to a line."""
    lines, current = [], "python launch.py"
    for word in (shell_word(o) for o in overrides):
        if len(current) + len(word) + 1 > 110:
            lines.append(current + " \\")
            current = "    " + word
        else:
            current += " " + word
    return "\n".join(lines + [current])
