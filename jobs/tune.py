"""Autotune a job: choose method, draft length and batch size from a pilot sample of the
job's own input, and predict the run's tokens/s before the big run.

    python jobs/tune.py --config configs/xsum.yaml --rows 64
    python jobs/tune.py --config configs/xsum.yaml --clock cpu --output out/tune/xsum   # shared CPU machine

Writes ``<output>/tuned.yaml`` (the input config with ``method`` and ``compute`` filled in;
run it with ``python jobs/summarize.py --config <output>/tuned.yaml``),
``<output>/tune_report.md`` with its plots, and ``tune_report.json``.  Prints the headline
as JSON.  (``--out`` is a deprecated alias of ``--output``.)

Exit status: 0 on success, 2 for a bad config / input / model path (before anything is
measured), 1 for any other failure.
"""

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: pipeline/, actors/

from pipeline.imports import require_packages  # noqa: E402

require_packages("jobs/tune.py")  # one line, exit 2, under a Python that lacks torch & co.

from pipeline.config import ConfigError, load_config  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``jobs/tune.py`` (flags: :mod:`pipeline.flags`; defaults: ``TuneOptions``)."""
    from pipeline.engine import METHODS
    from pipeline.flags import build_parser as build_job_parser
    from pipeline.tune.tuner import CLOCKS, TuneOptions

    defaults = {f.name: f.default for f in dataclasses.fields(TuneOptions)}
    defaults["batch_sizes"] = list(defaults["batch_sizes"])
    del defaults["methods"], defaults["max_draft"], defaults["trees"]  # None / a switch: said in their help
    by_k: dict = {}
    for m in METHODS.values():
        if m.k_param is not None:
            by_k.setdefault(m.tune_k_max, []).append(m.name)
    own = "the config's"
    k_max = "; ".join(f"{k or own} for {', '.join(names)}" for k, names in by_k.items())
    return build_job_parser("tune", __doc__.split("\n")[0], defaults=defaults, choices={"clock": sorted(CLOCKS)},
                            notes={"config": "default: the built-in defaults",
                                   "max_draft": f"default: {k_max}; the config's draft length when longer",
                                   "output": "tuned.yaml, tune_report.md, its plots and tune_report.json; "
                                             "default: out/tune/<config name>"})


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from pipeline.models import ModelError
    from pipeline.input import InputError
    from pipeline.tune.report import summary, write_outputs
    from pipeline.tune.tuner import TuneOptions, read_raw_config, tune

    out = args.output or str(Path("out") / "tune" / (Path(args.config).stem if args.config else "default"))
    options = TuneOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TuneOptions)})
    options.batch_sizes = tuple(options.batch_sizes)
    options.methods = tuple(options.methods) if options.methods else None
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
