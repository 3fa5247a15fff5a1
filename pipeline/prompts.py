"""Stage 2, prompt: input text -> the prompt string and its token ids.

The task's template (``task.prompt_template`` or the task default) is filled with the
text (and the languages for translate).  When the chat template is on (``task.chat_template``:
``auto`` and the tokenizer has one, or ``true``), the filled template becomes one user
message (after an optional system message) rendered with ``add_generation_prompt=True``;
its special tokens come from the template, so the tokenizer adds none.  Otherwise the
tokenizer adds its usual special tokens (BOS for Llama).
"""

from __future__ import annotations

from typing import Any

from pipeline.config import ConfigError, TaskConfig


class PromptError(ValueError):
    """A row's text cannot make a prompt (null, empty, or not a string)."""


def fill_template(text: Any, task: TaskConfig) -> str:
    """The task template with ``{text}`` (and ``{source_lang}``, ``{target_lang}``) filled.

    Raises:
        PromptError: ``text`` is None, not a string, or blank.
    """
    if text is None:
        raise PromptError("prompt is null")
    if not isinstance(text, str):
        raise PromptError(f"prompt is a {type(text).__name__}, not a string")
    if not text.strip():
        raise PromptError("prompt is empty")
    return task.template.format(text=text, source_lang=task.source_lang or "", target_lang=task.target_lang or "")


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


class PromptBuilder:
    """Turns texts into ``(prompt_string, token_ids)`` for one tokenizer.

    Raises (constructor):
        ConfigError: ``task.chat_template`` is ``true`` but the tokenizer has none.
    """

    def __init__(self, tokenizer, task: TaskConfig):
        self.tokenizer = tokenizer
        self.task = task
        has_chat = bool(getattr(tokenizer, "chat_template", None))
        if task.chat_template is True and not has_chat:
            raise ConfigError("task.chat_template is true but the target's tokenizer has no chat template")
        self.use_chat = has_chat and task.chat_template in ("auto", True)

    def render(self, text: Any) -> str:
        """The prompt string the model sees (chat template applied when on)."""
        content = fill_template(text, self.task)
        if not self.use_chat:
            return content
        messages = []
        if self.task.system_prompt:
            messages.append({"role": "system", "content": self.task.system_prompt})
        messages.append({"role": "user", "content": content})
        return render_chat(self.tokenizer, messages)

    def build(self, text: Any) -> tuple[str, list[int]]:
        """``(prompt, ids)``: ids is a list of int token ids of the target tokenizer.

        Raises:
            PromptError: bad text (see :func:`fill_template`).
        """
        prompt = self.render(text)
        ids = self.tokenizer(prompt, add_special_tokens=not self.use_chat)["input_ids"]
        return prompt, list(ids)


#: the text :func:`check_prompt` renders the template with
SAMPLE_TEXT = "A sample sentence to check the prompt template."


def check_prompt(tokenizer, task: TaskConfig) -> str:
    """Render and tokenize one prompt in the driver, exactly as the actors will (template,
    chat template, system prompt), so a template that fails fails the job before any model
    loads, instead of every row after.  Returns the rendered sample prompt.

    Raises:
        ConfigError: naming the task keys involved (``task.chat_template``,
            ``task.system_prompt``, ``task.prompt_template``) and the template's error.
    """
    builder = PromptBuilder(tokenizer, task)
    try:
        prompt, ids = builder.build(SAMPLE_TEXT)
    except Exception as e:  # noqa: BLE001 - jinja errors, a template raising on a role, ...
        keys = ["task.prompt_template"]
        if builder.use_chat:
            keys = ["task.chat_template (the target tokenizer's chat template)"]
            if task.system_prompt:
                keys.append("task.system_prompt")
        detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(f"the prompt cannot be rendered with {' and '.join(keys)}: {type(e).__name__}: {detail}") from None
    if not ids:
        raise ConfigError("the prompt template renders to no tokens (task.prompt_template)")
    return prompt
