"""The config walk of ``compute.draft_length``: the functions the value passes through on its
way from the command line to the engine, counted.

    python scripts/config_walk.py           # the counts
    python scripts/config_walk.py --list    # and every function, with its module

What is traced (``sys.setprofile``, Python frames of this repository only):

1. ``jobs/summarize.py --print-config --set compute.draft_length=fixed`` (the command line
   parsed, the config loaded, checked and printed: :func:`pipeline.cli.main`);
2. the driver's preflight (:func:`pipeline.run.preflight`: the input listed, the models'
   configs checked, the run's identity, the nightly-reuse plan, the output's lease), on the
   config's input and model, into a temporary output folder;
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
counted (every function given the config would be a stay).
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
ARGS = ["--print-config", "--set", f"compute.draft_length={VALUE}", "--set", "method.name=prompt_lookup",
        "--set", "cpu.kernels=false"]


def _holds(x, depth: int = 2) -> bool:
    from pipeline.config import ComputeConfig

    if isinstance(x, ComputeConfig):
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

    def __call__(self, frame, event, arg):
        if event not in ("call", "return"):
            return
        file = frame.f_code.co_filename
        if not file.startswith(str(ROOT)) or "/.venv/" in file or file == __file__:
            return
        name = f"{Path(file).relative_to(ROOT)}:{frame.f_code.co_qualname}"
        try:
            held = any(_holds(v) for k, v in frame.f_locals.items() if k != "self")
            if event == "return" and _holds(arg):
                self.returns.add(name)
                held = True
        except Exception:  # noqa: BLE001 - a half-built object's repr or comparison
            return
        if held:
            self.stays[name] = str(Path(file).relative_to(ROOT).with_suffix("")).replace("/", ".")


def tiny_models():
    """A tiny random Llama in place of the configured models (no weights read)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.models import LoadedModels

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return LoadedModels(LlamaForCausalLM(config).eval(), None, None, None, "cpu")


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
                          [a for a in ARGS[1:] if a != "--set"] + [f"output.uri={out}"])
        assert cfg.compute.draft_length == VALUE
        from pipeline.run import preflight

        sys.setprofile(w)
        try:
            pre = preflight(cfg)
        finally:
            sys.setprofile(None)
        pre.writer.release_lease()
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
    args = parser.parse_args(argv)
    w = walk()
    rooms = sorted(set(w.stays.values()))
    if args.list:
        for name in sorted(w.stays):
            print(("returns  " if name in w.returns else "         ") + name)
    print(f"compute.draft_length: {len(w.stays)} stays in {len(rooms)} rooms with {len(w.returns)} returns")
    return 0


if __name__ == "__main__":
    sys.exit(main())
