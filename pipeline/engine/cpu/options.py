"""Which parts of the CPU acceleration are on, read once at load: :class:`CpuOptions`.

The job config's ``cpu:`` section holds them (one key per field, derived from this dataclass by
:mod:`pipeline.config`); the environment overrides the config, one variable per field
(``SPECBATCH_CPU_<FIELD>``, e.g. ``SPECBATCH_CPU_LEAN_PASS=0``) plus the older names
``SPECBATCH_FUSED`` (the lean pass) and ``SPECBATCH_INDUCTOR`` (both inductor parts).  This
module is the only one under ``pipeline/engine/`` that reads the environment: the rest of the
engine takes the options :func:`with_environment` returns, when a model is prepared.

It also owns where inductor keeps what it compiles (:func:`use_compile_cache`): one folder per
user and node, so that the actors of one node compile a graph once between them.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

#: the prefix of the environment variable of each field (``SPECBATCH_CPU_LEAN_PASS``)
ENV_PREFIX = "SPECBATCH_CPU_"
#: older variable names, each setting these boolean fields
ENV_ALIASES = {"SPECBATCH_FUSED": ("lean_pass",), "SPECBATCH_INDUCTOR": ("rowdot", "compiled_layer")}
_FALSE = ("0", "false", "no", "off")
_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class CpuOptions:
    """Which parts of the engine's CPU acceleration a model prepared on the CPU gets
    (:func:`pipeline.engine.cpu.prepare`).  Each part changes float32 rounding (another summation
    order), never the math: greedy outputs equal plain decoding's in float64, and in float32
    differ only at measured near-ties.  What each part buys: ``docs/benchmarks.md``.

    Attributes:
        kernels: the whole CPU acceleration (false: every part below off, the model runs
            PyTorch's default kernels through its own forward).
        onednn: linear layers run oneDNN's kernel on a copy of their weight packed once into its
            blocked layout (which reads the weight once for a few rows of input); off: MKL's
            ``F.linear`` is the default kernel.
        transposed: for 1-8 rows of input, MKL's product with a transposed copy of the weight
            is offered to each weight shape (taken where measured faster at load; a third copy
            of the weights it serves).
        smallm: for 1-8 rows of input, the engine's small-M C kernel (``cpu/csrc/smallm.c``,
            built with gcc into the compile cache's folder at first use) on a copy of the
            weight packed once, which reads each weight once for all the rows, is offered to
            each float32 weight shape (taken where measured faster at load; a CPU with AVX2 and
            FMA; its sums are bitwise the same for every row count).
        rowdot: for 1-5 rows of input, a dot product per weight row compiled by PyTorch's
            inductor is offered to each float32 weight shape of at least 2^18 elements where
            ``smallm`` is not offered (taken where measured faster at load).

        small_query_attention: masked passes of up to 16 query tokens run SDPA with grouped
            key/value heads read once (``enable_gqa``) instead of transformers' copies of them.
        lean_pass: a Llama's forward runs the engine's lean pass (fused q/k/v and gate/up
            projections, no per-module Python) instead of transformers' forward.
        compiled_layer: in the lean pass, passes of 1-2 tokens in all run each layer outside
            attention as graphs compiled by inductor, where measured faster at load (float32
            weights of at least 2^18 elements).
        compile_cache: the folder inductor keeps compiled code in, shared by the processes of
            a node (null: ``$TORCHINDUCTOR_CACHE_DIR`` when set, else
            ``$XDG_CACHE_HOME/specbatch/inductor``, by default ``~/.cache/specbatch/inductor``).
        expected_tokens: the tokens a model is expected to decode in this process: the
            inductor parts (``rowdot``, ``compiled_layer``) compile only the graphs whose
            per-token saving, measured at load, repays their compiling over these tokens
            (:mod:`pipeline.engine.cpu.payoff`; graphs in the node's cache cost next to nothing).  null: unknown
            (a server, a bench): every offered graph is compiled.  The batch jobs set it from
            their rows when left null (rows x ``max_new_tokens`` x (1 + ``audit.fraction``) per actor).
    """

    kernels: bool = True
    onednn: bool = True
    transposed: bool = True
    smallm: bool = True
    rowdot: bool = True

    small_query_attention: bool = True
    lean_pass: bool = True
    compiled_layer: bool = True
    compile_cache: str | None = None
    expected_tokens: int | None = None

    def validate(self) -> "CpuOptions":
        """Itself; raises ``ValueError`` naming a field of the wrong type."""
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "compile_cache":
                if v is not None and (not isinstance(v, str) or not v.strip()):
                    raise ValueError(f"compile_cache must be a folder path or null, got {v!r}")
            elif f.name == "expected_tokens":
                if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                    raise ValueError(f"expected_tokens must be a whole number >= 0 or null, got {v!r}")
            elif not isinstance(v, bool):
                raise ValueError(f"{f.name} must be true or false, got {v!r}")
        return self

    def part_on(self, name: str) -> bool:
        """Whether part ``name`` (a boolean field) is on: itself and :attr:`kernels`."""
        return self.kernels and bool(getattr(self, name))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


#: the parts, in the order they are listed (every boolean field but the master switch)
PARTS = tuple(f.name for f in dataclasses.fields(CpuOptions) if f.type in (bool, "bool") and f.name != "kernels")
#: the fields that are not on/off switches, each with how its environment variable is read
_VALUES = {"compile_cache": lambda name, raw: raw.strip() or None, "expected_tokens": lambda name, raw: _count(name, raw)}


def _flag(name: str, value: str) -> bool:
    v = value.strip().lower()
    if v in _FALSE:
        return False
    if v in _TRUE:
        return True
    raise ValueError(f"environment variable {name}={value!r}: expected one of {', '.join(_TRUE + _FALSE)}")


def _count(name: str, value: str) -> int | None:
    v = value.strip().lower()
    if v in ("", "none", "null"):
        return None
    try:
        n = int(v)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"environment variable {name}={value!r}: expected a whole number >= 0 or none")
    return n


def env_variables() -> dict[str, str]:
    """Every environment variable :func:`with_environment` reads, with what it sets (the
    switches' table, :mod:`pipeline.switches`, lists them from here)."""
    out = {alias: ", ".join(fields) + " (older name)" for alias, fields in ENV_ALIASES.items()}
    for f in dataclasses.fields(CpuOptions):
        out[ENV_PREFIX + f.name.upper()] = f.name
    return out


def check_env_value(name: str, value: str) -> None:
    """Raise ``ValueError`` (naming ``name``) when ``value`` is not one :func:`with_environment`
    takes for the variable ``name`` (one of :func:`env_variables`)."""
    field = name[len(ENV_PREFIX):].lower() if name.startswith(ENV_PREFIX) else None
    (_VALUES.get(field) or _flag)(name, value)


def with_environment(options: CpuOptions | None = None) -> CpuOptions:
    """``options`` (default :class:`CpuOptions`) with what the environment sets: each field's
    ``SPECBATCH_CPU_<FIELD>``, and the aliases :data:`ENV_ALIASES` (a field's own variable wins).

    Raises:
        ValueError: a variable that is not a boolean word (naming it), or a bad option.
    """
    options = options or CpuOptions()
    changes: dict = {}
    for alias, fields in ENV_ALIASES.items():
        if alias in os.environ:
            changes.update(dict.fromkeys(fields, _flag(alias, os.environ[alias])))
    for f in dataclasses.fields(CpuOptions):
        name = ENV_PREFIX + f.name.upper()
        if name in os.environ:
            raw = os.environ[name]
            changes[f.name] = (_VALUES.get(f.name) or _flag)(name, raw)
    return dataclasses.replace(options, **changes).validate() if changes else options.validate()


def compile_cache_dir(options: CpuOptions) -> str:
    """The folder of inductor's on-disk cache for ``options`` (see :attr:`CpuOptions.compile_cache`)."""
    if options.compile_cache:
        return os.path.abspath(os.path.expanduser(options.compile_cache))
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return os.environ["TORCHINDUCTOR_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "specbatch", "inductor")


def use_compile_cache(options: CpuOptions) -> str:
    """Point inductor's on-disk cache (``TORCHINDUCTOR_CACHE_DIR``, read by inductor at each
    compile) at :func:`compile_cache_dir`, created if missing; returns the folder.  Every
    process of a node with the same options compiles into, and loads from, the same folder
    (inductor writes each entry atomically)."""
    path = compile_cache_dir(options)
    os.makedirs(path, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return path
