"""The planned cost of the phi sweep run independently (recipes/sweeps/phi: 16 runs, one per model and budget) and
branched (recipes/sweeps/phi-branched: 8 stable runs + 8 decay branches, the same 16 points of the law), side by side
with their ratios: training steps, tokens, training FLOPs (pipeline/studies/sweep_cost.py) and evaluation work.
Nothing trains: `python bench/phi_sweep_cost.py [--runs]` prints JSON (--runs: every run's row too)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.studies.sweep import plan_sweep  # noqa: E402

SWEEPS = Path(__file__).resolve().parents[1] / "recipes" / "sweeps"


def main() -> None:
    independent, branched = plan_sweep(SWEEPS / "phi"), plan_sweep(SWEEPS / "phi-branched")
    ti, tb = independent["total"], branched["total"]
    out = {"independent": {"folder": "recipes/sweeps/phi", **ti},
           "branched": {"folder": "recipes/sweeps/phi-branched", **tb},
           "ratio_branched_over_independent": {k: tb[k] / ti[k] for k in ti if ti[k]},
           "points_of_the_law": {"independent": ti["runs"] + ti["branches"], "branched": tb["runs"] + tb["branches"]}}
    if "--runs" in sys.argv:
        out["runs"] = {"independent": independent["runs"], "branched": branched["runs"]}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
