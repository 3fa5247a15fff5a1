"""The config walk of ``compute.draft_length``: the functions the value passes through on its
way from the command line to the engine, counted.

    python scripts/config_walk.py           # the counts
    python scripts/config_walk.py --list    # and every function, with its module
    python scripts/config_walk.py --whole-config  # a function given the whole JobConfig counts too

What is traced (``sys.setprofile``, Python frames of this repository only):

1. ``jobs/summarize.py --print-config --set compute.draft_length=fixed`` (the command line
   parsed, the config loaded, checked and printed: :func:`pipeline.cli.main`);
2. the driver's preflight (:func:`pipeline.run.preflight`: the input listed, the models'
   configs checked, the run's identity, the nightly-reuse plan, the output's lease), on the
   config's input and model, as a nightly run: into the ``date=`` partition of a temporary
   output (``--run-date``) whose night before is committed, with ``--previous auto``, so the
   nightly-reuse plan (:func:`pipeline.reuse.plan_reuse`) finds it, matches its fingerprint
   and reuses it (the night before: two units of two rows committed by an
   :class:`~pipeline.output.OutputWriter` under this run's own identity, nothing decoded);
3. the crossing to an actor (``JobConfig.model_validate(cfg.model_dump())``, as the
   processor hands the config to :class:`actors.generate.GenerateActor`) and the engine's
   construction there (:func:`pipeline.loading.load_engine`, on a tiny random Llama in place
   of the configured models, ``cpu.kernels`` off: nothing loaded or compiled).

A frame *holds* the value when one of its arguments or locals (or the value it returns) is
the ``compute`` section (a ``ComputeConfig``), the string ``"fixed"``, a string naming
``draft_length``, or a mapping or sequence holding one of those within two levels (the
config's resolved dict holds its ``compute`` section).  A *stay* is a function whose frame
held it at its call or its return; a *room* the module of a stay; a *return* a stay that
handed it back to its caller.  The whole :class:`JobConfig` object is not
counted (every function given the config would be a stay) unless ``--whole-config`` asks (an
upper bound).  The *reuse part* is the stays
met inside :func:`pipeline.reuse.plan_reuse` (the nightly-reuse preflight), counted apart too.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
VALUE = "fixed"
#: the nights of the traced nightly run: the one committed before, the one preflighted
NIGHTS = ("2026-01-01", "2026-01-02")
#: the function whose calls (and everything they call) are the nightly-reuse preflight
REUSE_ROOT = "plan_reuse"
#: ``--whole-config``: the whole JobConfig counts as holding the value too (an upper bound)
WHOLE_CONFIG = False
ARGS = ["--print-config", "--set", f"compute.draft_length={VALUE}", "--set", "method.name=prompt_lookup",
        "--set", "cpu.kernels=false"]


def _holds(x, depth: int = 2) -> bool:
    from pipeline.config import ComputeConfig, JobConfig

    if isinstance(x, ComputeConfig) or (WHOLE_CONFIG and isinstance(x, JobConfig)):
        return True
    if isinstance(x, str):
        return x == VALUE or "draft_length" in x
    if depth and isinstance(x, dict):
        return any(_holds(k, 0) or _holds(v, depth - 1) for k, v in list(x.items())[:200])
    if depth and isinstance(x, (list, tuple)):
        return any(_holds(v, depth - 1) for v in list(x)[:200])
    return False


class Walk:
    """``sys.setprofile`` hook: the stays, their rooms and the returns."""

    def __init__(self):
        self.stays: dict[str, str] = {}
        self.returns: set[str] = set()
        self.reuse: set[str] = set()  # stays met inside REUSE_ROOT
        self.reuse_calls: set[str] = set()  # every function of the repository called inside REUSE_ROOT

    def __call__(self, frame, event, arg):
        if event not in ("call", "return"):
            return
        file = frame.f_code.co_filename
        if not file.startswith(str(ROOT)) or "/.venv/" in file or file == __file__:
            return
        name = f"{Path(file).relative_to(ROOT)}:{frame.f_code.co_qualname}"
        f = frame
        while f is not None and f.f_code.co_name != REUSE_ROOT:
            f = f.f_back
        if f is not None:
            self.reuse_calls.add(name)
        try:
            held = any(_holds(v) for k, v in frame.f_locals.items() if k != "self")
            if event == "return" and _holds(arg):
                self.returns.add(name)
                held = True
        except Exception:  # noqa: BLE001 - a half-built object's repr or comparison
            return
        if held:
            self.stays[name] = str(Path(file).relative_to(ROOT).with_suffix("")).replace("/", ".")
            if name in self.reuse_calls:
                self.reuse.add(name)

    def counts(self, only: set[str] | None = None) -> tuple[int, int, int]:
        """(stays, rooms, returns), of every stay or of those in ``only``."""
        names = set(self.stays) if only is None else set(self.stays) & only
        return len(names), len({self.stays[n] for n in names}), len(names & self.returns)


def tiny_models():
    """A tiny random Llama in place of the configured models (no weights read)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.models import LoadedModels

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return LoadedModels(LlamaForCausalLM(config).eval(), None, None, None, "cpu")


def night_before(cfg, out: str) -> None:
    """The night before ``cfg``'s run date, committed and finished under ``out``: two units of
    two rows of one input file, written under the run's own config identity (so its reuse
    fingerprint matches and its rows are reused), nothing decoded."""
    import pyarrow as pa

    from pipeline.config import OutputConfig
    from pipeline.output import OutputWriter
    from pipeline.processor import check_generation
    from pipeline.run import run_identity
    from pipeline.schema import OUTPUT_SCHEMA
    from pipeline.units import Shard, Split, Unit

    source = str(ROOT / "data" / "demo_prompts.jsonl")
    shard = Shard(index=0, url=source, format="jsonl", num_rows=4, fingerprint="size=40;mtime=1")
    writer = OutputWriter(OutputConfig(uri=out, partition_by_date=True, run_date=NIGHTS[0]))
    units = [Unit(shard, k, Split(2 * k, 2)) for k in range(2)]
    writer.on_write_start(units, run_identity(cfg, check_generation(cfg), []))
    for unit in units:
        rows = range(unit.split.start, unit.split.start + 2)
        writer.write_part(unit, pa.Table.from_pylist([
            {"id": f"r{i}", "output_text": f"o{i}", "finish_reason": "length", "error": None, "source_file": source,
             "source_row": i, "output_token_ids": [i, 40 + i], "reuse_key": f"{i:032x}"} for i in rows],
            schema=OUTPUT_SCHEMA))
    writer.on_write_complete({"rows": 4})


def walk() -> Walk:
    from unittest import mock

    import pipeline.loading
    from pipeline.cli import main
    from pipeline.config import JobConfig, load_config
    from pipeline.flags import config_overrides  # noqa: F401 - imported before the trace starts

    models = tiny_models()
    w = Walk()
    sys.setprofile(w)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            code = main("summarize", ARGS)
    finally:
        sys.setprofile(None)
    assert code == 0, "jobs/summarize.py --print-config failed"
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(str(ROOT / "configs" / "summarize.yaml"),
                          [a for a in ARGS[1:] if a != "--set"] + [
                              f"output.uri={out}", "output.partition_by_date=true", f"output.run_date={NIGHTS[1]}",
                              "output.previous=auto"])
        assert cfg.compute.draft_length == VALUE
        from pipeline.run import preflight

        night_before(cfg, out)
        sys.setprofile(w)
        try:
            pre = preflight(cfg)
        finally:
            sys.setprofile(None)
        pre.writer.release_lease()
        assert pre.reuse.previous is not None, f"the night before was not reused: {pre.reuse.note}"
    with mock.patch.object(pipeline.loading, "load_job_models", lambda cfg, device=None: models):
        sys.setprofile(w)
        try:
            actor_cfg = JobConfig.model_validate(cfg.model_dump())
            loaded = pipeline.loading.load_engine(actor_cfg, "cpu")
        finally:
            sys.setprofile(None)
    assert loaded.engine.controller.fixed, "the engine did not get compute.draft_length=fixed"
    return w


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="every stay, with its module")
    parser.add_argument("--whole-config", action="store_true",
                        help="count a function given the whole JobConfig as a stay too (an upper bound)")
    args = parser.parse_args(argv)
    global WHOLE_CONFIG
    WHOLE_CONFIG = args.whole_config
    w = walk()
    if args.list:
        for name in sorted(w.stays):
            print(("returns " if name in w.returns else "        ") + ("reuse " if name in w.reuse else "      ") + name)
    print("compute.draft_length: %d stays in %d rooms with %d returns" % w.counts())
    print("  of which the nightly-reuse preflight: %d stays in %d rooms with %d returns (of its %d functions called)"
          % (*w.counts(w.reuse), len(w.reuse_calls)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
