"""Turn the real corpora in ``../shared/data`` into job inputs (JSONL with ``id``, ``text``, ``reference``).

    python jobs/prepare_inputs.py                  # writes out/inputs/*.jsonl
    python jobs/prepare_inputs.py --output DIR --data ../shared/data   (--out: a deprecated alias)

Outputs (the jobs read ``id`` and ``text``; ``reference`` is kept for scoring):

- ``xsum_1000.jsonl``: the 1,000 XSum BBC articles of ``xsum_helm_1000/xsum_0shot.jsonl``, with the
  HELM prompt wrapper (``###\\nArticle: `` ... ``Summarize the above article in 1 sentence.``)
  removed, so the job's own template applies; ids ``xsum-0000`` ... in file order.
  ``xsum_200.jsonl``: its first 200 rows (a quicker subset).
- ``spec_bench_summarization.jsonl``: Spec-Bench's 80 CNN/DM prompts (question ids 241-320) without
  their ``Summarize: `` prefix (configs/spec_bench_summarize.yaml puts it back); ids ``spec-bench-<id>``.
  ``spec_bench_summarization_50.jsonl``: its first 50 rows (configs/real/gemma3-smollm2-universal.yaml).
- ``spec_bench_translation.jsonl``: Spec-Bench's 80 WMT14 German sentences (ids 161-240) without
  ``Translate German to English: `` (configs/spec_bench_translate.yaml puts it back).

Then, e.g.: ``python jobs/summarize.py --config configs/xsum.yaml``.
"""

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the repo root: pipeline/

from pipeline.corpora import spec_bench_rows, xsum_rows  # noqa: E402
from pipeline.flags import build_parser as build_job_parser  # noqa: E402


def prepare(data: Path, out: Path) -> dict[str, int]:
    """Write the job inputs of the corpora in ``data`` (:mod:`pipeline.corpora`) into ``out``;
    returns the rows written per file."""
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    rows = xsum_rows(data)
    counts["xsum_1000.jsonl"] = _write(out / "xsum_1000.jsonl", rows)
    counts["xsum_200.jsonl"] = _write(out / "xsum_200.jsonl", rows[:200])  # a quicker subset
    summ, trans = spec_bench_rows(data, "summarization"), spec_bench_rows(data, "translation")
    counts["spec_bench_summarization.jsonl"] = _write(out / "spec_bench_summarization.jsonl", summ)
    counts["spec_bench_summarization_50.jsonl"] = _write(out / "spec_bench_summarization_50.jsonl", summ[:50])
    counts["spec_bench_translation.jsonl"] = _write(out / "spec_bench_translation.jsonl", trans)
    return counts


def _write(path: Path, rows: list[dict]) -> int:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return len(rows)


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``jobs/prepare_inputs.py`` (flags: :mod:`pipeline.flags`)."""
    return build_job_parser("prepare_inputs", __doc__.split("\n")[0],
                            defaults={"data": str(REPO.parent / "shared" / "data"), "output": str(REPO / "out" / "inputs")},
                            notes={"output": "where to write the JSONL inputs"})


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    for name, n in prepare(Path(args.data), Path(args.output)).items():
        print(f"{Path(args.output) / name}: {n} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
