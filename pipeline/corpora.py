"""The real corpora of ``../shared/data`` as job input rows, one owner for their wrappers.

``jobs/prepare_inputs.py`` writes them as the jobs' JSONL inputs; the training scripts
(``train/``) and the benches (``bench/``) read the same rows through here, so that every one
of them strips the same wrappers.

- XSum, HELM's sample (``xsum_helm_1000/xsum_0shot.jsonl``): each article is wrapped in
  HELM's prompt (:data:`HELM_PREFIX` ... :data:`HELM_SUFFIX`); :func:`xsum_rows` gives the
  bare article (the job's own template applies), ids ``xsum-0000``... in file order, and the
  reference summary.
- Spec-Bench (``spec_bench/question.jsonl``): :func:`spec_bench_rows` gives one category's
  prompts without their task prefix (:data:`SPEC_BENCH_PREFIX`; the configs put it back),
  ids ``spec-bench-<question id>``, and the reference.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: what HELM's XSum prompt puts before and after an article
HELM_PREFIX = "###\nArticle: "
HELM_SUFFIX = "\n\nSummarize the above article in 1 sentence.\n"
#: the task prefix of a Spec-Bench prompt, by category
SPEC_BENCH_PREFIX = {"summarization": "Summarize: ", "translation": "Translate German to English: "}


def strip_wrapper(s: str, prefix: str = "", suffix: str = "") -> str:
    """``s`` without ``prefix`` at its start and ``suffix`` at its end (each only when
    there), then stripped of surrounding whitespace."""
    if prefix and s.startswith(prefix):
        s = s[len(prefix):]
    if suffix and s.endswith(suffix):
        s = s[: -len(suffix)]
    return s.strip()


def xsum_rows(data: str | Path) -> list[dict[str, Any]]:
    """The 1,000 XSum articles of ``<data>/xsum_helm_1000/xsum_0shot.jsonl`` as ``{"id",
    "text", "reference"}`` rows (the article without HELM's wrapper, the reference summary)."""
    rows = []
    with open(Path(data) / "xsum_helm_1000" / "xsum_0shot.jsonl", encoding="utf-8") as f:
        for i, line in enumerate(f):
            r = json.loads(line)
            rows.append({"id": f"xsum-{i:04d}", "text": strip_wrapper(r["article"], HELM_PREFIX, HELM_SUFFIX),
                         "reference": r["summary_gt"]})
    return rows


def spec_bench_rows(data: str | Path, category: str) -> list[dict[str, Any]]:
    """Spec-Bench's prompts of ``category`` (``summarization``, ``translation``) in
    ``<data>/spec_bench/question.jsonl`` as ``{"id", "text", "reference"}`` rows, each
    without its task prefix (:data:`SPEC_BENCH_PREFIX`)."""
    rows = []
    with open(Path(data) / "spec_bench" / "question.jsonl", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if r["category"] == category:
                rows.append({"id": f"spec-bench-{r['question_id']}",
                             "text": strip_wrapper(r["turns"][0], SPEC_BENCH_PREFIX.get(category, "")),
                             "reference": r["reference"][0]})
    return rows
