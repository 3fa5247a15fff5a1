"""Structured output: a row's ``response_format`` as a grammar that masks the target.

The grammar library is llguidance (``docs/generation.md``, "Choosing the grammar library":
measured against xgrammar on this CPU; no grammar engine of our own).  This module owns:

- :func:`normalize_response_format`: the *shape* of a ``response_format`` (OpenAI's
  ``json_schema`` / ``json_object`` / ``text``, vLLM's ``regex`` / ``choice``), no tokenizer;
- :func:`compile_grammar`: the format compiled against a tokenizer, cached by content and
  bounded in time (:class:`CompiledGrammar`);
- :class:`GrammarState`: one row's matcher, positioned at any prefix of the row's output
  (the committed tokens, or those plus draft tokens during a verification pass): the token
  masks of consecutive positions, how many tokens of a draft the grammar allows, and the
  forced run that the grammar draft source offers (SGLang's jump-forward, made a draft that
  the target verifies like any other).

The matcher follows the tokens it is asked about: each query rolls it back to the longest
common prefix of what it consumed and the asked prefix, then consumes the rest, so the
grammar's state rolls back with the KV caches on rejection without a hook of its own.  The
masks are applied by :class:`~pipeline.engine.sampling.LogitsShaper` (a grammar is a per-row,
prefix-dependent logits processor), so verification stays in :mod:`pipeline.engine.verify`.

JSON is generated in the form ``json.dumps`` writes (``", "`` and ``": "``, no other
whitespace): the forms the grammar allows are fewer, so more tokens are forced.  EOS: the
row's EOS ids are allowed exactly where the grammar accepts; when nothing else can follow,
they are all it allows, so the row stops there.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

#: the ``type`` values of a ``response_format``
FORMAT_TYPES = ("json_schema", "json_object", "text", "regex", "choice")
#: llguidance's JSON options: json.dumps's separators, no free whitespace
JSON_OPTIONS = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
#: compiled grammars kept (least recently used dropped first)
CACHE_SIZE = 256


class GrammarError(ValueError):
    """A ``response_format`` that cannot be used: its message names the field, the schema's
    name where it has one, and the grammar library's reason."""


class _Timeout(GrammarError):
    """A compilation over its time (not remembered: a later call may allow more)."""


def normalize_response_format(rf: Any) -> dict | None:
    """The canonical form of a ``response_format`` (shape only; nothing is compiled).

    Accepted (a JSON string of one of them too): OpenAI's
    ``{"type": "json_schema", "json_schema": {"name": str, "schema": {...}, "strict": bool}}``
    (``name`` and ``strict`` optional), ``{"type": "json_object"}``, ``{"type": "text"}``; vLLM's
    ``{"type": "regex", "regex": str}`` and ``{"type": "choice", "choice": [str, ...]}``.

    Returns:
        ``None`` for ``None`` and ``text`` (no constraint), else a new dict whose own keys (and
        ``json_schema``'s) are sorted, so that equal formats compare and serialise equal; the
        schema itself keeps its order (the order of ``properties`` is the order the JSON is
        generated in).

    Raises:
        GrammarError: naming the bad field (``response_format.type``,
            ``response_format.json_schema.schema``, ...).
    """
    if rf is None:
        return None
    if isinstance(rf, str):
        try:
            rf = json.loads(rf)
        except json.JSONDecodeError as e:
            raise GrammarError(f"response_format is a string but not JSON: {e}") from None
    if not isinstance(rf, dict):
        raise GrammarError(f"response_format must be an object with a 'type', got {type(rf).__name__}")
    kind = rf.get("type")
    if kind not in FORMAT_TYPES:
        raise GrammarError(f"response_format.type must be one of {FORMAT_TYPES}, got {kind!r}")
    allowed = {"json_schema": {"json_schema"}, "regex": {"regex"}, "choice": {"choice"}}.get(kind, set())
    unknown = sorted(set(rf) - allowed - {"type"})
    if unknown:
        raise GrammarError(f"response_format of type {kind!r} has unknown field(s) {', '.join(unknown)}")
    if kind == "text":
        return None
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise GrammarError("response_format.json_schema must be an object with a 'schema'")
        extra = sorted(set(js) - {"name", "schema", "strict", "description"})
        if extra:
            raise GrammarError(f"response_format.json_schema has unknown field(s) {', '.join(extra)}")
        name = js.get("name")
        if name is not None and (not isinstance(name, str) or not name):
            raise GrammarError(f"response_format.json_schema.name must be a non-empty string, got {name!r}")
        if not isinstance(js.get("schema"), dict):
            raise GrammarError(f"response_format.json_schema.schema{_named(name)} must be a JSON object (a JSON "
                               f"Schema), got {type(js.get('schema')).__name__}")
        if "strict" in js and not isinstance(js["strict"], bool):
            raise GrammarError(f"response_format.json_schema.strict must be true or false, got {js['strict']!r}")
    elif kind == "regex":
        if not isinstance(rf.get("regex"), str) or not rf["regex"]:
            raise GrammarError(f"response_format.regex must be a non-empty string, got {rf.get('regex')!r}")
    elif kind == "choice":
        c = rf.get("choice")
        if not isinstance(c, list) or not c or not all(isinstance(s, str) and s for s in c):
            raise GrammarError(f"response_format.choice must be a non-empty list of non-empty strings, got {c!r}")
    try:
        out = json.loads(json.dumps(rf))
    except (TypeError, ValueError) as e:
        raise GrammarError(f"response_format is not JSON-serialisable: {e}") from None
    if kind == "json_schema":
        out["json_schema"] = dict(sorted(out["json_schema"].items()))
    return dict(sorted(out.items()))


def _named(name: str | None) -> str:
    return f" (schema {name!r})" if name else ""


def _describe(fmt: dict) -> str:
    """How an error names a format: its type and, for a schema, its name."""
    if fmt["type"] == "json_schema":
        return f"response_format.json_schema{_named(fmt['json_schema'].get('name'))}"
    return f"response_format.{fmt['type']}" if fmt["type"] in ("regex", "choice") else "response_format"


def _grammar_source(fmt: dict) -> str:
    """llguidance's grammar for a canonical format."""
    from llguidance import LLMatcher

    kind = fmt["type"]
    if kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(fmt["json_schema"]["schema"], defaults=dict(JSON_OPTIONS))
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=dict(JSON_OPTIONS))
    if kind == "regex":
        return LLMatcher.grammar_from_regex(fmt["regex"])
    # choice: a Lark alternation of JSON string literals (each choice verbatim)
    return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in fmt["choice"]))


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A ``response_format`` compiled against one tokenizer (:func:`compile_grammar`).

    Attributes:
        format: the canonical format (:func:`normalize_response_format`).
        grammar: llguidance's grammar (its JSON form).
        tokenizer: llguidance's ``LLTokenizer`` over the target's vocabulary.
        vocab_size: the target's vocabulary size ``V`` (the masks' width).
        library_eos: the id llguidance allows where the grammar accepts (replaced by the row's
            EOS ids in :meth:`GrammarState.masks`).
    """

    format: dict
    grammar: str
    tokenizer: Any
    vocab_size: int
    library_eos: int

    def state(self, eos_token_ids: Sequence[int]) -> "GrammarState":
        """A fresh matcher for one row (at the start of its output)."""
        return GrammarState(self, eos_token_ids)


_lock = threading.Lock()
_tokenizers: dict[tuple, tuple[Any, Any]] = {}  # (id, vocab) -> (the HF tokenizer, kept alive; LLTokenizer)
_compiled: "OrderedDict[tuple, CompiledGrammar | GrammarError]" = OrderedDict()


def _lltokenizer(tokenizer, vocab_size: int):
    key = (id(tokenizer), vocab_size)
    with _lock:
        hit = _tokenizers.get(key)
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    import llguidance.hf

    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise GrammarError("response_format needs a tokenizer with an EOS token (eos_token_id is None)")
    try:
        lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
    except Exception as e:  # noqa: BLE001 - the library's reason, named
        raise GrammarError(f"the grammar library cannot read the tokenizer: {type(e).__name__}: {e}") from None
    with _lock:
        _tokenizers[key] = (tokenizer, lltok)
    return lltok


def compile_grammar(response_format, tokenizer, vocab_size: int, timeout_s: float = 10.0) -> CompiledGrammar:
    """Compile a ``response_format`` against the target's tokenizer, once per content.

    Args:
        response_format: any form :func:`normalize_response_format` accepts (not ``None`` /
            ``text``).
        tokenizer: the target's Hugging Face *fast* tokenizer (the grammar library reads its
            token strings).
        vocab_size: the target's vocabulary size (may exceed the tokenizer's: the extra ids
            are never allowed).
        timeout_s: seconds the compilation may take (wall clock) before the format is refused.

    Returns:
        A :class:`CompiledGrammar`, shared by every caller with an equal format and the same
        tokenizer object and vocabulary size (a thousand rows with one schema compile it
        once; a refused format is remembered too).

    Raises:
        GrammarError: a bad shape, a schema / regex the library refuses (its reason quoted),
            a tokenizer it cannot read, or a compilation over ``timeout_s``.
    """
    fmt = normalize_response_format(response_format)
    if fmt is None:
        raise GrammarError("response_format of type 'text' has no grammar to compile")
    key = (json.dumps(fmt), id(tokenizer), vocab_size)  # the schema's order matters (the order it generates in)
    with _lock:
        hit = _compiled.get(key)
        if hit is not None:
            _compiled.move_to_end(key)
    if hit is None:
        hit = _compile(fmt, tokenizer, vocab_size, timeout_s)
        if isinstance(hit, _Timeout):
            raise GrammarError(str(hit))
        with _lock:
            _compiled[key] = hit
            while len(_compiled) > CACHE_SIZE:
                _compiled.popitem(last=False)
    if isinstance(hit, GrammarError):
        raise GrammarError(str(hit))
    return hit


def _new_matcher(lltok, source: str):
    """llguidance's matcher of ``source`` (its construction compiles the grammar)."""
    from llguidance import LLMatcher

    return LLMatcher(lltok, source, log_level=0)


def _compile(fmt: dict, tokenizer, vocab_size: int, timeout_s: float) -> CompiledGrammar | GrammarError:
    try:
        lltok = _lltokenizer(tokenizer, vocab_size)
        source = _grammar_source(fmt)
    except GrammarError as e:
        return e
    except (ValueError, TypeError) as e:
        return GrammarError(f"{_describe(fmt)} is refused by the grammar library: {e}")
    out: dict[str, Any] = {}

    def build():  # the matcher's construction compiles the grammar (llguidance drops the GIL)
        try:
            m = _new_matcher(lltok, source)
            out["error"] = m.get_error() if m.is_error() else ""
        except Exception as e:  # noqa: BLE001 - the library's reason, named
            out["error"] = f"{type(e).__name__}: {e}"

    worker = threading.Thread(target=build, name="compile_grammar", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        return _Timeout(f"{_describe(fmt)} did not compile within {timeout_s:g} s (too complex for the grammar "
                            "library); simplify it")
    if out["error"]:
        return GrammarError(f"{_describe(fmt)} is refused by the grammar library: {out['error'].strip()}")
    return CompiledGrammar(fmt, source, lltok, vocab_size, int(tokenizer.eos_token_id))


_BITS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``(n, ceil(V / 32))`` int32 packed masks (bit ``j`` of word ``w``: token ``32 w + j``)
    -> ``(n, V)`` bool."""
    bits = (words.unsqueeze(-1) >> _BITS) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab_size].bool()


@dataclass
class GrammarState:
    """One row's grammar matcher (:meth:`CompiledGrammar.state`).

    Every query takes the row's *output* so far (token ids after the prompt, as a list) and
    moves the matcher there first (:meth:`_goto`), so callers never roll it back themselves.
    A token the grammar forbids is never consumed (the matcher would stay in error):
    positions after it get the mask before it.

    Attributes:
        forced_at: per output index, whether the grammar allowed one token alone there (set
            when that position's mask is computed; :attr:`RowStats.forced_tokens` counts it).
    """

    compiled: CompiledGrammar
    eos_token_ids: Sequence[int]
    consumed: list[int] = field(default_factory=list)
    forced_at: dict[int, bool] = field(default_factory=dict)

    def __post_init__(self):
        self.matcher = _new_matcher(self.compiled.tokenizer, self.compiled.grammar)
        self.eos_token_ids = sorted(set(int(e) for e in self.eos_token_ids))
        self._words = torch.empty(1, (self.compiled.vocab_size + 31) // 32, dtype=torch.int32)

    def _goto(self, output: Sequence[int]) -> int:
        """Move the matcher to ``output``; returns how many of its tokens it holds (all,
        unless one is forbidden: the grammar's valid prefix)."""
        c = 0
        n = min(len(self.consumed), len(output))
        while c < n and self.consumed[c] == output[c]:
            c += 1
        if c < len(self.consumed):
            self.matcher.rollback(len(self.consumed) - c)
            del self.consumed[c:]
        rest = list(output[c:])
        if rest:
            ok = self.matcher.validate_tokens(rest)
            if ok:
                self.matcher.consume_tokens(rest[:ok])
                self.consumed.extend(rest[:ok])
        return len(self.consumed)

    def _mask(self, index: int) -> torch.Tensor:
        """``(V,)`` bool: the tokens allowed at the matcher's position (output index ``index``),
        the library's EOS replaced by the row's EOS ids where the grammar accepts."""
        m = self.matcher
        m.unsafe_compute_mask_ptr(self._words.data_ptr(), self._words.numel() * 4)
        mask = unpack_bitmask(self._words, self.compiled.vocab_size)[0]
        mask[self.compiled.library_eos] = False
        if m.is_accepting() or m.is_stopped():
            mask[self.eos_token_ids] = True
        self.forced_at[index] = int(mask.sum()) == 1
        return mask

    def masks(self, output: Sequence[int], extra: Sequence[int], n: int) -> torch.Tensor:
        """``(n, V)`` bool: position ``i``'s allowed tokens after ``output + extra[:i]``
        (``extra``: the draft tokens of a verification pass, at least ``n - 1``)."""
        out = torch.empty(n, self.compiled.vocab_size, dtype=torch.bool)
        base = list(output)
        held = self._goto(base)
        stuck = held < len(base)
        for i in range(n):
            if i and not stuck:
                ok = self.matcher.validate_tokens([int(extra[i - 1])])
                if ok:
                    self.matcher.consume_token(int(extra[i - 1]))
                    self.consumed.append(int(extra[i - 1]))
                else:
                    stuck = True
            out[i] = out[i - 1] if stuck and i else self._mask(len(base) + i)
        return out

    def valid_prefix(self, output: Sequence[int], draft: Sequence[int]) -> int:
        """How many leading tokens of ``draft`` the grammar allows after ``output`` (an EOS
        id counts where the grammar accepts; nothing follows it)."""
        self._goto(output)
        draft = [int(t) for t in draft]
        ok = self.matcher.validate_tokens(draft) if draft else 0
        if ok < len(draft) and draft[ok] in self.eos_token_ids:
            self.matcher.consume_tokens(draft[:ok])
            accepting = self.matcher.is_accepting() or self.matcher.is_stopped()
            self.matcher.rollback(ok)
            return ok + 1 if accepting else ok
        return ok

    def forced(self, output: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens the grammar forces after ``output`` (llguidance's fast-forward
        tokens), then the row's EOS where the grammar then stops; ``[]`` when none."""
        if k < 1 or self._goto(output) < len(output):
            return []
        m = self.matcher
        run = [int(t) for t in m.compute_ff_tokens()][:k]
        if len(run) < k and len(self.eos_token_ids) == 1:  # the run ends the grammar: EOS follows it
            if run:
                m.consume_tokens(run)
            stopped = m.is_stopped() and not m.is_error()
            if run:
                m.rollback(len(run))
            if stopped:
                run.append(self.eos_token_ids[0])
        return run

    def complete(self, output: Sequence[int]) -> bool:
        """Whether ``output`` (a final EOS left out) is a whole sentence of the grammar."""
        output = list(output)
        if output and output[-1] in self.eos_token_ids:
            output = output[:-1]
        return self._goto(output) == len(output) and self.matcher.is_accepting()
