"""docs/controller.png: the draft length the engine's controller chooses, against the rows in
flight and the proposer's confidence, from the controller's own code
(:class:`pipeline.engine.draft_control.DraftController`) on a synthetic cost curve.

The curve is SmolLM2-135M's verification on one CPU thread as docs/engine.md gives it
(``t(1..5)`` at one row 26 / 28.5 / 30.7 / 32 / 34 ms, ``t(1..4)`` at 8 rows 55 / 72 / 86 /
97 ms), fed to a :class:`~pipeline.engine.cost_model.CostCurve`, whose fit extrapolates to
the other numbers of rows.  Every row offers a draft of 6 tokens whose per-token confidence
is ``c`` (calibrated: nothing measured yet, so the estimate is ``c``); the plot shows the
tokens each row verifies.  Usage::

    python scripts/plot_controller.py [--output docs/controller.png]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: measured seconds of a step's verification by (rows, width): docs/engine.md, "CPU kernels"
MEASURED = {(1, w): t / 1e3 for w, t in zip(range(1, 6), (26.0, 28.5, 30.7, 32.0, 34.0))}
MEASURED.update({(8, w): t / 1e3 for w, t in zip(range(1, 5), (55.0, 72.0, 86.0, 97.0))})
CONFIDENCES = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
ROWS = range(1, 17)
K = 6


def curve():
    """A :class:`CostCurve` that has measured :data:`MEASURED` (a few steps of each shape)."""
    from pipeline.engine.cost_model import CostCurve

    c = CostCurve()
    for _ in range(4):
        for (rows, width), seconds in MEASURED.items():
            c.observe(rows, width, seconds)
    return c


def chosen(rows: int, confidence: float, costs) -> int:
    """Tokens each of ``rows`` rows verifies when every row offers ``K`` tokens at ``confidence``."""
    import torch

    from pipeline.engine.draft_control import DraftController, RowEvidence
    from pipeline.engine.proposers.base import Draft

    controller = DraftController(K)
    controller.curve = costs
    evidence = [RowEvidence() for _ in range(rows)]
    plan = controller.lengths(evidence, [K] * rows)
    drafts = [Draft(torch.arange(K), confidence=torch.full((K,), confidence, dtype=torch.float64), source="prompt")
              for _ in range(rows)]
    return max(len(d) for d in controller.cut(plan, drafts, evidence).drafts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output", default=str(ROOT / "docs" / "controller.png"))
    args = ap.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    costs = curve()
    fig, ax = plt.subplots(figsize=(8, 4), dpi=110)
    for c in CONFIDENCES:
        ax.plot(list(ROWS), [chosen(b, c, costs) for b in ROWS], marker="o", markersize=3, label=f"{c}")
    ax.set_xlabel("rows in flight")
    ax.set_ylabel("draft tokens verified per row")
    ax.set_yticks(range(K + 1))
    ax.set_title("The controller's draft length (SmolLM2-135M, one CPU thread)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="proposer's\nconfidence", title_fontsize=8)
    fig.tight_layout()
    fig.savefig(args.output)
    print(args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
