"""The verdict: one row per check (result, largest relative difference, seconds, what it found),
as a short table for people and as JSON for CI (docs/verify.md has the format)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import List, Optional

from megatron_hydra.config import Derived


def describe(d: Derived) -> str:
    """A layout in one word per dimension: ``tp2 x pp2 x vpp2 x cp2 x ep2 x dp2``."""
    parts = [f"tp{d.tp}", f"pp{d.pp}"] + ([f"vpp{d.vpp}"] if d.vpp > 1 else []) + \
        ([f"cp{d.cp}"] if d.cp > 1 else []) + ([f"ep{d.ep}"] if d.ep > 1 else []) + [f"dp{d.dp}"]
    return " x ".join(parts)


@dataclass
class Check:
    name: str
    passed: Optional[bool]  # None: not run (skipped)
    largest: Optional[float] = None  # the largest relative difference, where the check compares
    seconds: float = 0.0
    detail: str = ""  # the first difference, the failure, or what was compared


@dataclass
class Verdict:
    model: str
    layout: str
    shrunk: str
    reduced: List[str] = field(default_factory=list)
    checks: List[Check] = field(default_factory=list)
    fit_table: str = ""
    notes: List[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.passed is not False for c in self.checks)

    def to_json(self) -> str:
        out = asdict(self)
        out["passed"] = self.passed
        for c in out["checks"]:
            if c["largest"] is not None and not math.isfinite(c["largest"]):
                c["largest"] = "nan" if math.isnan(c["largest"]) else "inf"  # JSON has neither
        return json.dumps(out, indent=2)

    def table(self) -> str:
        lines = [f"verify: model={self.model} at {self.layout}; shrunk: {self.shrunk}"]
        lines += [f"  reduced: {r}" for r in self.reduced]
        lines += [f"  note: {n}" for n in self.notes]
        if self.fit_table:
            lines += ["", self.fit_table, ""]
        lines.append(f"{'check':<8} {'result':<8} {'largest diff':>13} {'seconds':>8}  detail")
        for c in self.checks:
            result = "skipped" if c.passed is None else ("pass" if c.passed else "FAIL")
            largest = "" if c.largest is None else f"{c.largest:.2e}"
            lines.append(f"{c.name:<8} {result:<8} {largest:>13} {c.seconds:>8.1f}  {c.detail}")
        lines.append("verdict: " + ("PASS" if self.passed else "FAIL"))
        return "\n".join(lines)
