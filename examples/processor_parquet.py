"""Speculative decoding inside your own Ray Data pipeline: read Parquet, filter, run the
specbatch processor, write Parquet with ``ds.write_parquet``.

    python examples/processor_parquet.py                      # the demo pair, the bundled articles
    python examples/processor_parquet.py --input s3://lake/articles/ --output s3://lake/summaries/ \\
        --config configs/summarize.yaml

Without ``--input`` it first writes the bundled demo articles (data/demo_prompts.jsonl) as a
Hive-partitioned Parquet dataset (``lang=en/``) to read back, so it runs from a fresh clone
(``SPECBATCH_SKIP_REAL_MODELS=1 bash scripts/setup.sh`` is enough).  Each output row keeps
the input's columns (``id``, ``text``, the ``lang`` partition) plus ``summary`` and the
speculation statistics the postprocess keeps.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def demo_parquet(folder: Path) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in (REPO / "data" / "demo_prompts.jsonl").read_text().splitlines() if line]
    table = pa.table({"id": [r["id"] for r in rows], "text": [r["text"] for r in rows], "lang": ["en"] * len(rows)})
    pq.write_to_dataset(table, str(folder), partition_cols=["lang"])
    return str(folder)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO / "configs" / "demo-summarize.yaml"), help="job config (YAML)")
    p.add_argument("--input", help="Parquet file or folder (default: the demo articles, written first)")
    p.add_argument("--output", default=str(REPO / "out" / "example-processor"), help="output folder")
    p.add_argument("--min-words", type=int, default=20, help="keep articles of at least this many words")
    p.add_argument("--max-new-tokens", type=int, default=32)
    args = p.parse_args(argv)

    import ray

    from pipeline.processor import build_processor

    processor = build_processor(
        args.config,
        # the article through the task's prompt template (the `text` column) is the default;
        # here each row asks for its own budget
        preprocess=lambda row: {"max_new_tokens": args.max_new_tokens},
        postprocess=lambda row: {"id": row["id"], "lang": row["lang"], "text": row["text"],
                                 "summary": row["output_text"], "error": row["error"],
                                 "new_tokens": row["new_tokens"], "acceptance_rate": row["acceptance_rate"],
                                 "tokens_per_step": row["tokens_per_step"]},
    )
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        source = args.input or demo_parquet(Path(tmp) / "articles")
        ds = ray.data.read_parquet(source)
        ds = ds.filter(lambda row: len(row["text"].split()) >= args.min_words)
        ds = processor(ds)
        ds.write_parquet(args.output)  # runs the pipeline
    import pyarrow.parquet as pq

    table = pq.read_table(args.output)
    print(f"{table.num_rows} rows -> {args.output}")
    for row in table.slice(0, 3).to_pylist():
        print(f"{row['id']}: {row['summary']!r} (acceptance {row['acceptance_rate']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
