"""Autotune a job: choose method, draft length and batch size from a pilot sample of the
job's own input, and predict the run's tokens/s before the big run.

    python jobs/tune.py --config configs/xsum.yaml --rows 64
    python jobs/tune.py --config configs/xsum.yaml --clock cpu --out out/tune/xsum   # shared CPU machine

Writes ``<out>/tuned.yaml`` (the input config with ``method`` and ``compute`` filled in; run
it with ``python jobs/summarize.py --config <out>/tuned.yaml``), ``<out>/tune_report.md``
with its plots, and ``tune_report.json``.  Prints the headline as JSON.

Exit status: 0 on success, 2 for a bad config / input / model path (before anything is
measured), 1 for any other failure.
"""

import argparse
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: pipeline/, actors/

from pipeline.imports import require_packages  # noqa: E402

require_packages("jobs/tune.py")  # one line, exit 2, under a Python that lacks torch & co.

from pipeline.config import ConfigError, load_config  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    from pipeline.tune.tuner import CLOCKS, DEFAULT_BATCH_SIZES

    p = argparse.ArgumentParser(prog="jobs/tune.py", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML job config (default: the built-in defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set generation.max_new_tokens=32 (repeatable)")
    p.add_argument("--rows", type=int, default=64, help="pilot rows: the first N rows of the input (default 64)")
    p.add_argument("--out", help="output directory (default: out/tune/<config name>)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=list(DEFAULT_BATCH_SIZES), metavar="B",
                   help=f"batch sizes to consider (default: {' '.join(map(str, DEFAULT_BATCH_SIZES))})")
    p.add_argument("--methods", nargs="+", metavar="NAME",
                   help="methods to consider (default: every one the configured models allow)")
    p.add_argument("--max-draft", type=int, metavar="K",
                   help="longest draft tried (default: 8 for model drafters, 10 for prompt lookup)")
    p.add_argument("--pilot-batch-size", type=int, default=8, help="rows in flight in the pilot runs (default 8)")
    p.add_argument("--repeats", type=int, default=3, help="timings per profiled figure, median kept (default 3)")
    p.add_argument("--confirm", type=int, default=3, help="top candidates confirmed on the pilot rows (default 3)")
    p.add_argument("--confirm-rows", type=int, default=32,
                   help="pilot rows each confirmation run decodes (default 32)")
    p.add_argument("--no-adaptive", action="store_true",
                   help="do not try per-row adaptive draft lengths (heuristic schedule, confidence threshold)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall time (default) or the process's CPU time (steadier on a shared CPU machine)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from pipeline.models import ModelError
    from pipeline.read import InputError
    from pipeline.tune.report import summary, write_outputs
    from pipeline.tune.tuner import TuneOptions, read_raw_config, tune

    out = args.out or str(Path("out") / "tune" / (Path(args.config).stem if args.config else "default"))
    options = TuneOptions(rows=args.rows, batch_sizes=tuple(args.batch_sizes),
                          methods=tuple(args.methods) if args.methods else None, max_draft=args.max_draft,
                          pilot_batch_size=args.pilot_batch_size, repeats=args.repeats, confirm=args.confirm,
                          confirm_rows=args.confirm_rows, adaptive=not args.no_adaptive,
                          clock=args.clock)
    try:
        cfg = load_config(args.config, args.overrides)
        raw = read_raw_config(args.config, args.overrides)
        result = tune(cfg, options, raw_config=raw, config_path=args.config,
                      log=lambda line: print(line, file=sys.stderr, flush=True))
        paths = write_outputs(result, out)
    except (ConfigError, InputError, ModelError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({**summary(result), "tuned_config": str(paths["config"]), "report": str(paths["report"])},
                     indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
