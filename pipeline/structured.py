"""The structured-output columns of a row: ``output_json`` and ``output_valid``.

A row with a ``response_format`` (job-wide ``generation.response_format`` or its own, from
``input.params_column``) was decoded under a grammar (:mod:`pipeline.engine.grammar`).  Its
output is *valid* when the grammar completed (the engine's ``grammar_complete``; a row
copied from a previous output: ``finish_reason`` ``stop``) and the text parses: as JSON for
``json_schema`` (validated against the schema with the ``jsonschema`` library too) and
``json_object``; for ``regex`` when the whole text matches; for ``choice`` when it is one
of the choices.  A row cut by its budget before the grammar completed has ``finish_reason``
``length`` and ``output_valid`` false, never a silently invalid value.

``output_json`` is the parsed value re-serialised (compact JSON, keys in the model's
order) for JSON formats, the JSON string of the text for ``regex`` / ``choice``; null when
not valid.  Rows without a format get null in both.
"""

from __future__ import annotations

import json
import re
from typing import Any


def structured_columns(text: str | None, finish_reason: str | None, response_format: dict[str, Any] | None,
                       grammar_complete: bool | None = None) -> dict[str, Any]:
    """``{"output_json": str | None, "output_valid": bool | None}`` of one row.

    Args:
        text: the row's output text (special tokens skipped).
        finish_reason: ``stop`` / ``length`` / ``context``.
        response_format: the row's canonical format (:func:`pipeline.engine.grammar.normalize_response_format`),
            or None (then both columns are None).
        grammar_complete: the engine's :attr:`GenerationResult.grammar_complete` (None: not
            known, e.g. a copied row: ``finish_reason == "stop"`` stands for it).
    """
    if response_format is None:
        return {"output_json": None, "output_valid": None}
    complete = grammar_complete if grammar_complete is not None else finish_reason == "stop"
    value, ok = _parse(text or "", response_format) if complete else (None, False)
    return {"output_json": json.dumps(value, ensure_ascii=False, separators=(",", ":")) if ok else None,
            "output_valid": bool(ok)}


def _parse(text: str, rf: dict[str, Any]) -> tuple[Any, bool]:
    kind = rf.get("type")
    if kind in ("json_schema", "json_object"):
        try:
            value = json.loads(text)
        except ValueError:
            return None, False
        if kind == "json_object":
            return value, isinstance(value, dict)
        schema = (rf.get("json_schema") or {}).get("schema") or {}
        import jsonschema

        try:
            jsonschema.validate(value, schema)
        except jsonschema.ValidationError:
            return None, False
        except jsonschema.SchemaError:
            return None, False
        return value, True
    if kind == "regex":
        return text, re.fullmatch(rf.get("regex") or "", text) is not None
    if kind == "choice":
        return text, text in (rf.get("choice") or [])
    return None, False
