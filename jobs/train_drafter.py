"""Train, or continue training, the draft head of method ``eagle`` on a job's own outputs.

    python jobs/train_drafter.py --from out/summarize/date=2026-12-01 --output out/heads/2026-12-01
    python jobs/train_drafter.py --from out/summarize/date=2026-12-01 --head models/smollm2-135m-eagle --output out/heads/2026-12-01 --steps 40 --promote-to models/heads/current

Reads the committed rows of ``--from`` (only the units its commit log commits; an output that
mixes configs is refused), rebuilds each row's prompt and answer ids as the job made them,
holds back ``--holdout`` of the rows, trains the head teacher-forced on the rest (resumable:
``<output>/train_state.safetensors``, never a pickle), measures its acceptance before and after on the held-back
rows, writes ``<output>/report.json``, and with ``--promote-to`` copies the head there only
when it is better.  The recipe, step by step: :mod:`train.drafter_from_outputs`.

Exit status: 0 on success (whether or not the head was promoted), 2 for bad input before
any training (not a job output, no usable rows, no rows held back, a missing model or head,
an ``--output`` or ``--promote-to`` holding something else, a training state that is not
safetensors + JSON), 1 for any other failure.
"""

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the repo root: pipeline/, train/

from pipeline.imports import require_packages  # noqa: E402

require_packages("jobs/train_drafter.py")  # one line, exit 2, under a Python that lacks torch & co.

from pipeline.config import JobRefused  # noqa: E402
from train.drafter_from_outputs import REPORT, Options, run  # noqa: E402


def build_parser():
    """The parser of ``jobs/train_drafter.py`` (flags: :mod:`pipeline.flags`)."""
    from pipeline.flags import build_parser as build_job_parser

    d = Options()
    return build_job_parser(
        "train_drafter", __doc__.split("\n")[0],
        defaults={"steps": d.steps, "holdout": d.holdout, "max_draft": d.max_draft, "lr": d.lr,
                  "tokens_per_step": d.tokens_per_step, "seed": d.seed, "storage_options": "{}"},
        notes={"config": "the job's config; needed only when the output has no _summary.json",
               "target": "default: the job's models.target",
               "head": "default: the job's models.drafter when it ran method eagle, else a new head",
               "output": "required: the trained head (config.json, model.safetensors), train_state.safetensors, report.json",
               "max_draft": "acceptance is measured at k = 1 .. K"})


def options_from_args(args) -> Options:
    so = json.loads(args.storage_options or "{}")
    if args.endpoint_url:
        so.setdefault("client_kwargs", {})["endpoint_url"] = args.endpoint_url
    return Options(source=args.source, output=args.output, config=args.config, target=args.target, head=args.head,
                   steps=args.steps, holdout=args.holdout, max_draft=args.max_draft, promote_to=args.promote_to,
                   lr=args.lr, tokens_per_step=args.tokens_per_step, max_rows=args.max_rows, seed=args.seed,
                   storage_options=so)


def print_report(report: dict) -> None:
    acc = report["acceptance"]
    K = acc["max_draft"]
    rows = report["rows"]
    print(f"held-back rows: {rows['held_back']} ({acc['before']['blocks']} block starts); trained "
          f"{report['training']['steps']} steps on {rows['trained_on']} rows")
    print("acceptance, teacher-forced greedy drafts (rate α, mean accepted length τ):")
    print("   k   before α  before τ   after α  after τ")
    for k in range(1, K + 1):
        b, a = acc["before"]["by_k"][k], acc["after"]["by_k"][k]
        print(f"  {k:2d}   {b['acceptance_rate'] or 0:7.3f}  {b['mean_accepted_length'] or 0:8.3f}  "
              f"{a['acceptance_rate'] or 0:8.3f}  {a['mean_accepted_length'] or 0:7.3f}")
    c = report["compared"]
    print(f"better: {report['better']} (τ at k={K}: trained {c['trained']:.3f}, current {c['current']:.3f}, "
          f"{c['current_head']})" + (f"; promoted to {report['promoted_to']}" if report["promoted_to"] else
                                     "; not promoted" if report["better"] == "current" else ""))


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        opts = options_from_args(args)
    except json.JSONDecodeError as e:
        print(f"error: --storage-options is not JSON: {e}", file=sys.stderr)
        return 2
    try:
        report = run(opts)
    except JobRefused as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - one line, exit 1
        print(f"error: {type(e).__name__}: {' '.join(str(e).split())[:500]}", file=sys.stderr)
        return 1
    print_report(report)
    print(f"report: {os.path.join(os.path.abspath(opts.output), REPORT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
