"""The flag table of every job's command line: one :class:`Flag` per flag, the same name and
meaning in every job (``--output`` is an output folder everywhere), and the flags of each
job (:data:`JOB_FLAGS`).  Each job's parser is built from here (:func:`build_parser`), and
the config overrides of the flags that set a config key come from here too
(:func:`config_overrides`); ``tests/pipeline/test_cli.py`` fails when a job adds or
changes a flag by hand.

Jobs: ``summarize``, ``translate`` and ``generate`` (:mod:`pipeline.cli`), ``serve``
(:mod:`pipeline.serve.app`), ``tune``, ``report``, ``prepare_inputs`` and ``train_drafter``
(``jobs/*.py``).

``--out`` is an alias of ``--output``, kept for one release (``jobs/tune.py``,
``jobs/report.py`` and ``jobs/prepare_inputs.py`` took ``--out`` before); using it prints a
note on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

#: deprecated alias -> the flag it stands for (accepted for one more release)
DEPRECATED_ALIASES = {"--out": "--output"}
#: jobs whose flags set config keys (the others take ``--config`` / ``--set`` and their own flags)
CONFIG_JOBS = ("summarize", "translate", "generate", "serve")


@dataclass(frozen=True)
class Flag:
    """One command-line flag.

    Attributes:
        name: the flag (``--max-batch-size``); its ``dest`` is the name without dashes
            (``max_batch_size``) unless ``dest`` is given.
        help: what it means, the same in every job (``{key}``: the config key it sets there).
        key: the dotted config key it overrides in the jobs whose flags set config keys
            (:data:`CONFIG_JOBS`; ``compute.max_batch_size``), or ``None`` for a flag that is
            not a config key; ``keys`` overrides it per job (``{"serve": "serve.max_batch_size"}``).
        type, nargs, metavar: as :meth:`argparse.ArgumentParser.add_argument` (choices come
            from the job: :func:`build_parser`).
        action: ``store_true`` / ``store_false`` / ``append`` (default: store a value).
        aliases: other spellings (``--out`` for ``--output``).
        also: further overrides applied when the flag is given (``--run-date`` turns
            ``output.partition_by_date`` on).
    """

    name: str
    help: str
    key: str | None = None
    keys: dict[str, str] = field(default_factory=dict)
    type: Callable[[str], Any] | None = None
    nargs: str | None = None
    metavar: str | None = None
    action: str | None = None
    aliases: tuple[str, ...] = ()
    also: tuple[str, ...] = ()
    dest: str | None = None

    @property
    def attr(self) -> str:
        """The attribute the parsed value lands on."""
        return self.dest or self.name.lstrip("-").replace("-", "_")

    def key_for(self, job: str) -> str | None:
        """The config key this flag sets in ``job`` (``None`` outside :data:`CONFIG_JOBS`)."""
        return self.keys.get(job, self.key) if job in CONFIG_JOBS else None


def _flags(*flags: Flag) -> dict[str, Flag]:
    return {f.attr: f for f in flags}


#: every flag of every job, by ``dest``
FLAGS: dict[str, Flag] = _flags(
    # the config
    Flag("--config", "YAML job config", metavar="PATH"),
    Flag("--set", "override a config key, e.g. --set generation.max_new_tokens=32 (repeatable)",
         action="append", metavar="KEY=VALUE", dest="overrides"),
    Flag("--print-config", "print the resolved config as JSON and exit", action="store_true"),
    # where rows come from and go
    Flag("--input", "input URI or glob (input.uri)", key="input.uri"),
    Flag("--output", "output folder", key="output.uri", aliases=("--out",)),
    Flag("--overwrite", "start afresh: delete the output's committed shards first (output.overwrite); "
                        "default: resume, skipping shards committed by an earlier run",
         key="output.overwrite", action="store_true"),
    Flag("--run-date", "write to <output>/date=YYYY-MM-DD/ (output.run_date, sets output.partition_by_date); "
                       "default with partition_by_date: today in UTC",
         key="output.run_date", metavar="YYYY-MM-DD", also=("output.partition_by_date=true",)),
    Flag("--previous", "copy, not decode, the rows an earlier output of this job holds unchanged (output.previous): "
                       "'auto' (the latest earlier complete date= partition of the output) or an output folder",
         key="output.previous", metavar="auto|FOLDER"),
    # the models and the method
    Flag("--method", "speculation method (method.name)", key="method.name"),
    Flag("--target", "target model path (models.target)", key="models.target"),
    Flag("--drafter", "drafter model path (models.drafter)", key="models.drafter"),
    Flag("--max-new-tokens", "generation.max_new_tokens", key="generation.max_new_tokens", type=int),
    # compute
    Flag("--num-actors", "compute.num_actors", key="compute.num_actors", type=int),
    Flag("--gpus-per-actor", "compute.gpus_per_actor", key="compute.gpus_per_actor", type=float),
    Flag("--rows-per-batch", "compute.rows_per_batch (rows per actor call)", key="compute.rows_per_batch", type=int),
    Flag("--max-batch-size", "rows in flight per engine ({key})",
         key="compute.max_batch_size", keys={"serve": "serve.max_batch_size"}, type=int),
    Flag("--audit-fraction", "re-decode this fraction of rows with plain decoding and count mismatches "
                             "(audit.fraction)", key="audit.fraction", type=float, metavar="F"),
    Flag("--no-progress", "hide the progress bar", action="store_true"),
    # the server
    Flag("--host", "serve.host (default 127.0.0.1)", key="serve.host"),
    Flag("--port", "serve.port (default 8000)", key="serve.port", type=int),
    Flag("--num-replicas", "serve.num_replicas", key="serve.num_replicas", type=int),
    Flag("--gpus-per-replica", "serve.gpus_per_replica", key="serve.gpus_per_replica", type=float),
    Flag("--model-name", "serve.model_name", key="serve.model_name"),
    Flag("--api-key", "require 'Authorization: Bearer KEY' on /v1/ (serve.api_key; default: $SPECBATCH_API_KEY)",
         key="serve.api_key", metavar="KEY"),
    # the tuner (pipeline.tune.tuner.TuneOptions fields)
    Flag("--rows", "pilot rows: the first N rows of the input", type=int),
    Flag("--batch-sizes", "batch sizes to consider", type=int, nargs="+", metavar="B"),
    Flag("--methods", "methods to consider (default: every one the configured models allow)", nargs="+",
         metavar="NAME"),
    Flag("--max-draft", "longest draft tried", type=int, metavar="K"),
    Flag("--pilot-batch-size", "rows in flight in the pilot runs", type=int),
    Flag("--repeats", "timings per profiled figure, median kept", type=int),
    Flag("--confirm", "top candidates confirmed on the pilot rows", type=int),
    Flag("--confirm-rows", "pilot rows each confirmation run decodes", type=int),
    Flag("--confirm-rounds", "interleaved rounds of confirmation runs, median kept", type=int),
    Flag("--no-trees", "do not try the chosen method with token trees (method.num_candidates)",
         action="store_false", dest="trees"),
    Flag("--clock", "wall time or the process's CPU time (steadier on a shared CPU machine)"),
    # the report
    Flag("--baseline", "method the speedup is measured against"),
    Flag("--title", "the report's title"),
    Flag("--storage-options", "fsspec storage options as JSON, e.g. '{\"anon\": true}'"),
    Flag("--endpoint-url", "S3 endpoint (shortcut for storage option client_kwargs.endpoint_url)"),
    # preparing inputs
    Flag("--data", "the shared corpora"),
    # training the draft head on a job's outputs
    Flag("--from", "a job's output folder: the one holding _manifest/ (local or any fsspec URL)", dest="source",
         metavar="FOLDER"),
    Flag("--head", "the draft head to continue training (a draft-head folder)", metavar="FOLDER"),
    Flag("--steps", "optimizer steps in all (a rerun continues up to this)", type=int),
    Flag("--holdout", "fraction of rows held back (by a hash of the row id) to measure acceptance on", type=float,
         metavar="F"),
    Flag("--promote-to", "write the trained head here only when its held-out acceptance beats the current head's",
         metavar="FOLDER"),
    Flag("--lr", "peak learning rate", type=float),
    Flag("--tokens-per-step", "head positions per optimizer step", type=int),
    Flag("--max-rows", "read at most this many committed rows", type=int),
    Flag("--seed", "seed of the held-back rows, the row order and the sampled positions", type=int),
)

_BATCH_JOB = ("config", "overrides", "input", "output", "method", "target", "drafter", "max_new_tokens",
              "num_actors", "gpus_per_actor", "rows_per_batch", "max_batch_size", "overwrite", "run_date",
              "previous", "audit_fraction", "print_config", "no_progress")

#: the flags of each job, by ``dest``, in ``--help`` order
JOB_FLAGS: dict[str, tuple[str, ...]] = {
    "summarize": _BATCH_JOB,
    "translate": _BATCH_JOB,
    "generate": _BATCH_JOB,
    "serve": ("config", "overrides", "host", "port", "method", "target", "drafter", "num_replicas",
              "gpus_per_replica", "max_batch_size", "model_name", "api_key", "print_config"),
    "tune": ("config", "overrides", "rows", "output", "batch_sizes", "methods", "max_draft", "pilot_batch_size",
             "repeats", "confirm", "confirm_rows", "confirm_rounds", "trees", "clock"),
    "report": ("output", "baseline", "title", "storage_options", "endpoint_url"),
    "prepare_inputs": ("data", "output"),
    "train_drafter": ("source", "config", "target", "head", "output", "steps", "holdout", "max_draft", "promote_to",
                      "lr", "tokens_per_step", "max_rows", "seed", "storage_options", "endpoint_url"),
}


class _DeprecatedAlias(argparse.Action):
    """Stores like the flag it stands for; a note on stderr when a deprecated alias is used."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string in DEPRECATED_ALIASES:
            print(f"note: {option_string} is a deprecated alias of {DEPRECATED_ALIASES[option_string]} "
                  "(accepted for one more release)", file=sys.stderr)
        setattr(namespace, self.dest, values)


def _show(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def build_parser(job: str, description: str, *, defaults: dict[str, Any] | None = None,
                 choices: dict[str, Sequence[str]] | None = None, notes: dict[str, str] | None = None,
                 prog: str | None = None,
                 parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The parser of ``job``: its flags of :data:`JOB_FLAGS`, from :data:`FLAGS`.

    Args:
        job: a key of :data:`JOB_FLAGS`.
        description: the parser's description.
        defaults: ``dest -> default`` for this job (shown in ``--help``); unset: ``None``
            (``[]`` for ``--set``, ``False`` / ``True`` for switches).
        choices: ``dest -> allowed values``, from their owner (the tuner's clocks, ...).
        notes: ``dest -> text`` appended to a flag's help in this job (what its output
            folder holds, a default computed later, ...).
        prog: the program name (default ``jobs/<job>.py``).
        parser: add to this parser (one with positional arguments) instead of a new one.

    Raises:
        KeyError: an unknown job, or a default / note for a flag the job does not take.
    """
    names = JOB_FLAGS[job]
    defaults, choices, notes = dict(defaults or {}), dict(choices or {}), dict(notes or {})
    unknown = sorted((set(defaults) | set(choices) | set(notes)) - set(names))
    if unknown:
        raise KeyError(f"job {job!r} takes no flag {', '.join(unknown)}")
    p = parser or argparse.ArgumentParser(prog=prog or f"jobs/{job}.py", description=description,
                                          formatter_class=argparse.RawDescriptionHelpFormatter)
    for dest in names:
        f = FLAGS[dest]
        kw: dict[str, Any] = {"dest": f.attr}
        help_text = f.help.replace("{key}", str(f.key_for(job)))
        if dest in notes:
            help_text += f" ({notes[dest]})"
        if f.action in ("store_true", "store_false"):
            kw["action"] = f.action
        else:
            if f.action == "append":
                kw.update(action="append", default=list(defaults.get(dest, [])))
            else:
                kw["action"] = _DeprecatedAlias if any(a in DEPRECATED_ALIASES for a in f.aliases) else "store"
                kw["default"] = defaults.get(dest)
                if defaults.get(dest) is not None:
                    help_text += f" (default: {_show(defaults[dest])})"
            for name in ("type", "nargs", "metavar"):
                if getattr(f, name) is not None:
                    kw[name] = getattr(f, name)
            if dest in choices:
                kw["choices"] = list(choices[dest])
        p.add_argument(f.name, *f.aliases, help=help_text, **kw)
    return p


def config_overrides(job: str, args: argparse.Namespace) -> list[str]:
    """``section.key=value`` overrides from the parsed flags of ``job``: ``--set`` ones first,
    then each given flag that sets a config key (values as JSON, which is YAML: ``"123"``
    stays a string), and what it implies (:attr:`Flag.also`)."""
    out = list(getattr(args, "overrides", None) or [])
    for dest in JOB_FLAGS[job]:
        f = FLAGS[dest]
        key = f.key_for(job)
        value = getattr(args, f.attr)
        if key is None or value is None or value is False:
            continue
        out.append(f"{key}={json.dumps(value)}")
        out.extend(f.also)
    return out


def flag_names(job: str) -> Sequence[str]:
    """Every option string ``job`` accepts (aliases included), ``--help`` left out."""
    return [s for dest in JOB_FLAGS[job] for s in (FLAGS[dest].name, *FLAGS[dest].aliases)]
