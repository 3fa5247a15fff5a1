"""Stage 2, prompt: input text -> the prompt string and its token ids.

The task's template (``task.prompt_template`` or the task default) is filled with the
text (and the languages for translate).  When the chat template is on (``task.chat_template``:
``auto`` and the tokenizer has one, or ``true``), the filled template becomes one user
message (after an optional system message) rendered with ``add_generation_prompt=True``;
its special tokens come from the template, so the tokenizer adds none.  Otherwise the
tokenizer adds its usual special tokens (BOS for Llama).

User text stays text.  A row's text (and, in the server, every chat message's content) may
hold the string of a special token, e.g. ``<|im_end|>`` then ``<|im_start|>system``: a
plain tokenization would turn it into the real control tokens and let the text forge turns
of the conversation.  :func:`encode_protected` tokenizes the template's parts as usual
(its special tokens are real) and the user's parts with transformers'
``split_special_tokens=True`` (a special-token string becomes the ordinary tokens of its
characters).  A prompt whose user text holds no special-token string is tokenized in one
piece, exactly as before, so ordinary rows keep their ids; only a prompt where a special
token would come out of the user's text is tokenized part by part.  The ``prompt`` string
(the Parquet's ``prompt`` column) is the same either way.  The raw ``prompt`` of the
server's ``/v1/completions`` is not user text in this sense: it is sent as the model's
input, special tokens included, as in OpenAI's and vLLM's completions API.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Callable, Sequence

from pipeline.config import ConfigError, TaskConfig


class PromptError(ValueError):
    """A row's text cannot make a prompt (null, empty, or not a string)."""


def fill(template: str, values: dict[str, str]) -> str:
    """``template`` with each ``{name}`` replaced by ``values[name]``, by concatenation: a
    value is never formatted or evaluated, so a value holding ``{other}`` stays literal
    (``{{``/``}}`` in the template are literal braces, as in ``str.format``).

    Raises:
        KeyError: a placeholder with no value.
    """
    import string

    return "".join(literal + (values[name] if name is not None else "")
                   for literal, name, _, _ in string.Formatter().parse(template))


def as_text(value: Any) -> str:
    """A column value as the text a template holds: a string as it is, anything else
    (number, boolean, list, struct) as JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)


def template_values(values: dict[str, Any], task: TaskConfig, text_column: str = "text") -> dict[str, str]:
    """The checked text of every column placeholder of the task's template, from ``values``
    (placeholder name -> the row's value; ``text`` is ``input.text_column``'s); the task's
    own placeholders (translate's languages) are :meth:`TaskConfig.task_values`.

    Raises:
        PromptError: a named column is null or missing from the row (naming it), or the
            ``{text}`` value is not a string or blank (as before columns: "prompt is ...").
    """
    out: dict[str, str] = {}
    for name in task.columns:
        v = values.get(name)
        if name == "text":
            where = "" if text_column == "text" else f" (column {text_column!r})"
            if v is None:
                raise PromptError(f"prompt is null{where}")
            if not isinstance(v, str):
                raise PromptError(f"prompt is a {type(v).__name__}, not a string{where}")
            if not v.strip() and len(task.columns) == 1:
                raise PromptError(f"prompt is empty{where}")
            out[name] = v
        elif v is None:
            raise PromptError(f"column {name!r} is null (task.prompt_template names it)")
        else:
            out[name] = as_text(v)
    return out


def fill_template(text: Any, task: TaskConfig) -> str:
    """The task template with ``{text}`` (and ``{source_lang}``, ``{target_lang}``) filled
    (a template naming other columns: use :func:`template_values` and :func:`fill`).

    Raises:
        PromptError: ``text`` is None, not a string, or blank.
    """
    return fill(task.template, {**task.task_values(), **template_values({"text": text}, task)})


def render_chat(tokenizer, messages: list[dict[str, Any]], chat_template: str | None = None) -> str:
    """Chat messages (``[{"role": ..., "content": ...}, ...]``) -> the prompt string, rendered
    with ``chat_template`` (default: the tokenizer's) and ``add_generation_prompt=True``.
    Its special tokens come from the template: tokenize it with ``add_special_tokens=False``.

    Raises:
        ValueError: no template (the tokenizer has none and none is given), or the template
            refuses the messages (e.g. a role it does not know).
    """
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("the target's tokenizer has no chat template")
    try:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=True)
    except Exception as e:  # jinja2 errors, raise_exception() in templates
        raise ValueError(f"the chat template cannot render these messages: {type(e).__name__}: {e}") from None


def special_token_ids(tokenizer) -> frozenset[int]:
    """Ids of the tokenizer's control tokens, which user text never produces: its named
    special tokens (BOS, EOS, ``<|im_start|>``...) and every added token, marked special or
    not (Gemma 3's ``<start_of_image>`` is an added token not marked special), but for added
    tokens that are only whitespace (Gemma's runs of newlines and tabs: the ordinary
    tokens of such text)."""
    return frozenset(_special_ids(tokenizer)) | frozenset(added_text_tokens(tokenizer))


def _special_ids(tokenizer) -> set[int]:
    ids = {i for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
           if getattr(t, "special", False)}
    ids.update(i for i in (getattr(tokenizer, "all_special_ids", None) or []) if i is not None)
    return ids


def added_text_tokens(tokenizer) -> dict[int, str]:
    """``id -> string`` of the tokenizer's added tokens that are not marked special (and not
    whitespace only): control tokens that ``split_special_tokens`` does not split (see
    :func:`_as_text_ids`)."""
    special = _special_ids(tokenizer)
    return {i: t.content for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
            if not getattr(t, "special", False) and i not in special and str(t.content).strip()}


def _as_text_ids(tokenizer, text: str, added: dict[int, str]) -> list[int]:
    """``text`` tokenized with every control-token string in it as ordinary tokens: special
    ones by ``split_special_tokens``, added ones not marked special (which the tokenizer
    always matches) as the tokens of their first character, then of the rest.

    Raises:
        PromptError: such a string cannot be spelled with ordinary tokens (its pieces do not
            decode back to it).
    """
    ids = list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    if not any(i in added for i in ids):
        return ids
    out: list[int] = []
    for i in ids:
        content = added.get(i)
        if content is None:
            out.append(i)
            continue
        spelled = (list(tokenizer(content[:1], add_special_tokens=False, split_special_tokens=True)["input_ids"])
                   + _as_text_ids(tokenizer, content[1:], added) if len(content) > 1 else [])
        if not spelled or any(j in added for j in spelled) \
                or tokenizer.decode(spelled, skip_special_tokens=False) != content:
            raise PromptError(f"the text holds the control-token string {content!r}, which this tokenizer cannot "
                              "spell with ordinary tokens, so it cannot be kept as plain text")
        out += spelled
    return out


def encode_protected(tokenizer, render: Callable[[Sequence[str]], str], pieces: Sequence[str], *,
                     add_special_tokens: bool, special_ids: frozenset[int] | None = None) -> tuple[str, list[int]]:
    """Render a prompt around user-provided ``pieces`` and tokenize it so that special-token
    strings in the pieces stay text (see the module docstring).

    Args:
        render: ``pieces -> prompt string``; called with the pieces, and with placeholders
            in their place to find where each piece lands.
        pieces: the user's texts, in the order ``render`` takes them.
        add_special_tokens: whether the tokenizer adds its own special tokens (BOS), as for
            ``tokenizer(prompt, add_special_tokens=...)``.
        special_ids: :func:`special_token_ids` of the tokenizer (computed when None).

    Returns:
        ``(prompt, ids)``.

    Raises:
        PromptError: a piece holds a special-token string and the template does not place
            the pieces verbatim (it trims or rewrites a message's content), so the parts
            that are the user's cannot be told apart.
    """
    prompt = render(pieces)
    ids = list(tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])
    special = special_token_ids(tokenizer) if special_ids is None else special_ids
    if not any(i in special for i in ids):
        return prompt, ids
    segments = _segments(render, pieces, prompt)
    if segments is None:
        strings = [t for t in tokenizer.convert_ids_to_tokens(sorted(special)) if t]
        if any(t in p for p in pieces for t in strings):
            raise PromptError("the text holds a special-token string, and the chat template does not place the text "
                              "verbatim, so it cannot be kept as plain text")
        return prompt, ids
    spans, pos = [], 0
    for text, user in segments:
        if user:
            spans.append((pos, pos + len(text)))
        pos += len(text)
    if not _special_in_spans(tokenizer, prompt, add_special_tokens, special, spans):
        return prompt, ids
    out: list[int] = []
    added = added_text_tokens(tokenizer) if special & set(ids) - _special_ids(tokenizer) else {}
    for text, user in segments:
        if text and user:
            out += _as_text_ids(tokenizer, text, added)
        elif text:
            out += tokenizer(text, add_special_tokens=False)["input_ids"]
    if add_special_tokens:
        prefix, suffix = _added_special(tokenizer)
        out = prefix + out + suffix
    return prompt, out


def _segments(render, pieces: Sequence[str], prompt: str) -> list[tuple[str, bool]] | None:
    """``prompt`` as ``[(text, is_user)]``, from a render with a unique placeholder per
    piece; None when the pieces are not placed verbatim, once each."""
    marks = [f"\x00{uuid.uuid4().hex}{i}\x00" for i in range(len(pieces))]
    skeleton = render(marks)
    found = []
    for i, m in enumerate(marks):
        if skeleton.count(m) != 1:
            return None
        found.append((skeleton.index(m), i))
    segments, pos = [], 0
    for at, i in sorted(found):
        segments += [(skeleton[pos:at], False), (pieces[i], True)]
        pos = at + len(marks[i])
    segments.append((skeleton[pos:], False))
    if "".join(t for t, _ in segments) != prompt:
        return None
    return segments


def _special_in_spans(tokenizer, prompt: str, add_special_tokens: bool, special: frozenset[int],
                      spans: list[tuple[int, int]]) -> bool:
    """Whether a special token of ``prompt``'s plain tokenization was spelled out inside a
    user span (not one that stands for other characters, as ``<unk>`` does); a tokenizer
    without offsets: whether any special token is there at all."""
    try:
        enc = tokenizer(prompt, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
    except (NotImplementedError, KeyError, ValueError, TypeError):
        return True
    for i, (a, b) in zip(enc["input_ids"], offsets):
        if i in special and b > a and any(a < e and s < b for s, e in spans) \
                and prompt[a:b] == tokenizer.convert_ids_to_tokens(i):
            return True
    return False


def _added_special(tokenizer) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after a text with ``add_special_tokens=True``."""
    bare = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    full = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    for i in range(len(full) - len(bare) + 1):
        if full[i:i + len(bare)] == bare:
            return full[:i], full[i + len(bare):]
    return [], []


class PromptBuilder:
    """Turns texts into ``(prompt_string, token_ids)`` for one tokenizer.

    Raises (constructor):
        ConfigError: ``task.chat_template`` is ``true`` but the tokenizer has none.
    """

    def __init__(self, tokenizer, task: TaskConfig, text_column: str = "text"):
        self.tokenizer = tokenizer
        self.task = task
        self.text_column = text_column
        has_chat = bool(getattr(tokenizer, "chat_template", None))
        if task.chat_template is True and not has_chat:
            raise ConfigError("task.chat_template is true but the target's tokenizer has no chat template")
        self.use_chat = has_chat and task.chat_template in ("auto", True)
        self.special_ids = special_token_ids(tokenizer)

    def render(self, text: Any) -> str:
        """The prompt string the model sees (chat template applied when on), of a template
        naming only ``{text}``; :meth:`render_values` for any columns."""
        return self.render_values({"text": text})

    def render_values(self, values: dict[str, Any]) -> str:
        """The prompt string of a row whose placeholders' values are ``values``."""
        filled = template_values(values, self.task, self.text_column)
        names = list(filled)
        return self._render(names, [filled[n] for n in names])

    def _render(self, names: Sequence[str], pieces: Sequence[str]) -> str:
        content = fill(self.task.template, {**self.task.task_values(), **dict(zip(names, pieces))})
        if not self.use_chat:
            return content
        messages = []
        if self.task.system_prompt:
            messages.append({"role": "system", "content": self.task.system_prompt})
        messages.append({"role": "user", "content": content})
        return render_chat(self.tokenizer, messages)

    def build(self, text: Any) -> tuple[str, list[int]]:
        """``(prompt, ids)`` of a template naming only ``{text}`` (:meth:`build_values`)."""
        return self.build_values({"text": text})

    def build_values(self, values: dict[str, Any]) -> tuple[str, list[int]]:
        """``(prompt, ids)``: ids is a list of int token ids of the target tokenizer; a
        special-token string in a value stays text (:func:`encode_protected`).

        Args:
            values: placeholder name -> the row's value (``text``: ``input.text_column``'s).

        Raises:
            PromptError: a null named column, a bad ``{text}`` (see :func:`template_values`),
                or a value holding a special-token string under a chat template that
                rewrites the message.
        """
        filled = template_values(values, self.task, self.text_column)
        names = list(filled)
        return encode_protected(self.tokenizer, lambda pieces: self._render(names, pieces),
                                [filled[n] for n in names], add_special_tokens=not self.use_chat,
                                special_ids=self.special_ids)


def encode_chat(tokenizer, messages: list[dict[str, Any]], chat_template: str | None = None,
                add_special_tokens: bool = False, special_ids: frozenset[int] | None = None) -> tuple[str, list[int]]:
    """Chat messages -> ``(prompt, ids)``, rendered as :func:`render_chat` does, with every
    message's content kept as text: a special-token string in it becomes ordinary tokens
    (:func:`encode_protected`); the template's own special tokens are real.

    Raises:
        ValueError: the template cannot render the messages (see :func:`render_chat`).
        PromptError: a content holds a special-token string and the template does not place
            contents verbatim.
    """
    def render(contents: Sequence[str]) -> str:
        return render_chat(tokenizer, [dict(m, content=c) for m, c in zip(messages, contents)], chat_template)

    return encode_protected(tokenizer, render, [m.get("content") or "" for m in messages],
                            add_special_tokens=add_special_tokens, special_ids=special_ids)


#: the roles a chat message may have (OpenAI's chat format; ``developer`` is OpenAI's newer ``system``)
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_messages(raw: Any) -> list[dict[str, str]]:
    """A row's chat messages in OpenAI's format, checked: a list (or a JSON string of one) of
    ``{"role": ..., "content": ...}`` objects, ``content`` a string or a list of text parts
    (``[{"type": "text", "text": ...}]``, joined).  Other keys of a message (``name``...) are kept.

    Raises:
        PromptError: naming the problem and the message (``messages[2].role: ...``).
    """
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise PromptError(f"messages: not JSON ({e})") from None
    if raw is None:
        raise PromptError("messages: null")
    if not isinstance(raw, (list, tuple)) or not raw:
        raise PromptError(f"messages: must be a non-empty list of {{role, content}} objects, got {_kind(raw)}")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise PromptError(f"messages[{i}]: must be a {{role, content}} object, got {_kind(m)}")
        role, content = m.get("role"), m.get("content")
        if role not in CHAT_ROLES:
            raise PromptError(f"messages[{i}].role: must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        if isinstance(content, (list, tuple)):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise PromptError(f"messages[{i}].content: a list of parts must hold only "
                                  "{type: text, text: ...} parts")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise PromptError(f"messages[{i}].content: must be a string, got {_kind(content)}")
        out.append({**{k: v for k, v in m.items() if v is not None}, "role": role, "content": content})
    return out


def _kind(v: Any) -> str:
    return "null" if v is None else type(v).__name__


#: the text :func:`check_prompt` renders the template with
SAMPLE_TEXT = "A sample sentence to check the prompt template."
#: the longest :func:`check_prompt` lets one sample prompt render (seconds): a chat template
#: that loops without bound (Jinja's sandbox bounds one ``range`` but not nested ones) is refused
RENDER_TIMEOUT_S = 10.0
#: the longest sample prompt :func:`check_prompt` accepts (characters)
MAX_SAMPLE_PROMPT_CHARS = 1_000_000


class _RenderTimeout(Exception):
    pass


def _bounded(fn, timeout_s: float):
    """``fn()``, interrupted after ``timeout_s`` seconds (SIGALRM; in the main thread only,
    elsewhere unbounded) with :class:`_RenderTimeout`."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        return fn()

    def on_alarm(signum, frame):
        raise _RenderTimeout(f"rendering took more than {timeout_s:g} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    old_timer = signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if old_timer[0]:
            signal.setitimer(signal.ITIMER_REAL, *old_timer)


def check_prompt(tokenizer, task: TaskConfig) -> str:
    """Render and tokenize one prompt in the driver, exactly as the actors will (template,
    chat template, system prompt), so a template that fails fails the job before any model
    loads, instead of every row after.  Returns the rendered sample prompt.

    The rendering is bounded: :data:`RENDER_TIMEOUT_S` seconds (in the main thread) and
    :data:`MAX_SAMPLE_PROMPT_CHARS` characters.

    Raises:
        ConfigError: naming the task keys involved (``task.chat_template``,
            ``task.system_prompt``, ``task.prompt_template``) and the template's error, or
            the bound it ran past.
    """
    builder = PromptBuilder(tokenizer, task)
    keys = ["task.prompt_template"]
    if builder.use_chat:
        keys = ["task.chat_template (the target tokenizer's chat template)"]
        if task.system_prompt:
            keys.append("task.system_prompt")
    try:
        sample = {c: SAMPLE_TEXT for c in task.columns}
        rendered = _bounded(lambda: builder.render_values(sample), RENDER_TIMEOUT_S)
        if len(rendered) > MAX_SAMPLE_PROMPT_CHARS:
            raise ConfigError(f"{' and '.join(keys)} render one sample prompt as {len(rendered)} characters (more "
                              f"than {MAX_SAMPLE_PROMPT_CHARS}): a template that repeats without bound?")
        prompt, ids = builder.build_values(sample)
    except ConfigError:
        raise
    except _RenderTimeout:
        raise ConfigError(f"{' and '.join(keys)} did not render one sample prompt in {RENDER_TIMEOUT_S:g} s: a "
                          "template that loops without bound?") from None
    except Exception as e:  # noqa: BLE001 - jinja errors, a template raising on a role, ...
        detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if "_RenderTimeout" in detail:  # wrapped by render_chat
            raise ConfigError(f"{' and '.join(keys)} did not render one sample prompt in {RENDER_TIMEOUT_S:g} s: "
                              "a template that loops without bound?") from None
        raise ConfigError(f"the prompt cannot be rendered with {' and '.join(keys)}: {type(e).__name__}: {detail}") from None
    if not ids:
        raise ConfigError("the prompt template renders to no tokens (task.prompt_template)")
    return prompt
