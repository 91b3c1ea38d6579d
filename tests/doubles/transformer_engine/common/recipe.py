"""TEST DOUBLE of transformer_engine.common.recipe: the recipe dataclasses' fields, as documented."""

from dataclasses import dataclass
from enum import Enum


class Format(Enum):
    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"  # E4M3 forward, E5M2 backward


@dataclass
class DelayedScaling:
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    reduce_amax: bool = True

    def __post_init__(self):
        assert self.fp8_format != Format.E5M2, "Pure E5M2 training is not supported."


@dataclass
class Float8CurrentScaling:
    fp8_format: Format = Format.HYBRID

    def __post_init__(self):
        assert self.fp8_format != Format.E5M2, "Pure E5M2 training is not supported."
