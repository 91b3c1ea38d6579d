"""The step-time model against published training throughputs, fitting rows and held-out rows.

For every row of ``planning.calibration`` (and SC21 Table 1, ``planning.sc21``): its source, GPU,
model, layout, the published number, the model's prediction with the shipped constants and the
relative error; then the rms and worst error of the fitting set and of the held-out set. Also
refits the Hopper constants on the fitting rows and prints them next to the shipped ones.

    python benchmarks/planner_validation.py      # a few seconds
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_hydra.planning import calibration  # noqa: E402
from megatron_hydra.planning.performance import CALIBRATED  # noqa: E402


def main() -> None:
    (eta, fp8, attn), rms = calibration.fit()
    print(f"refit on the H100 fitting rows: eta={eta:.3f} fp8_efficiency={fp8:.3f} attention_efficiency={attn:.3f} "
          f"(rms {rms:.1%}); shipped: eta={CALIBRATED.matmul_eta('H100-SXM5-80GB'):.3f} "
          f"fp8_efficiency={CALIBRATED.fp8_efficiency:.3f} attention_efficiency={CALIBRATED.attention_efficiency:.3f}; "
          f"A100 (SC21 fit): eta={CALIBRATED.eta:.3f} kappa={CALIBRATED.kappa:.3f}")
    found = calibration.results()
    header = (f"{'set':<5} {'source':<13} {'GPU':<5} {'model':<12} {'layout':<30} {'metric':<18} "
              f"{'published':>9} {'predicted':>9} {'error':>7}")
    print(header)
    for held in (False, True):
        for r in (r for r in found if r.held_out == held):
            print(f"{'held' if held else 'fit':<5} {r.source:<13} {r.gpu:<5} {r.model:<12} {r.layout:<30} {r.metric:<18} "
                  f"{r.published:>9.0f} {r.predicted:>9.0f} {r.error:>+7.1%}")
    for held, name in ((False, "fitting set"), (True, "held-out set")):
        rows = [r for r in found if r.held_out == held]
        rms, worst = calibration.summary(rows)
        print(f"{name}: {len(rows)} rows, rms error {rms:.1%}, worst {worst:.1%}, "
              f"{sum(abs(r.error) <= 0.15 for r in rows)} within 15%")


if __name__ == "__main__":
    main()
