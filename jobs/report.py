"""Report of one or more job outputs (one per method): ``report.md`` + PNG plots.

    python jobs/report.py out/xsum-plain out/xsum-draft_model out/xsum-prompt_lookup --out reports/xsum
    python jobs/report.py s3://bucket/runs/plain s3://bucket/runs/draft --out reports/s3 \\
        --endpoint-url http://127.0.0.1:9000

Each argument is a job output directory (local or any fsspec URL, e.g. ``s3://``).
Writes ``<out>/report.md`` (table + plots), ``report.json`` and three PNGs; prints the
table.  See pipeline/report.py for the definitions.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.imports import require_packages  # noqa: E402

require_packages("jobs/report.py")  # one line, exit 2, under a Python that lacks torch & co.

from pipeline.report import ReportError, markdown_table, write_report  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="jobs/report.py", description="Markdown + PNG report of specbatch run outputs.")
    p.add_argument("runs", nargs="+", metavar="RUN_OUTPUT_URI", help="job output directory (local, s3://, ...)")
    p.add_argument("--out", default="reports/latest", help="local directory for report.md and the PNGs")
    p.add_argument("--baseline", default="plain", help="method the speedup is measured against (default: plain)")
    p.add_argument("--title", default="specbatch run report")
    p.add_argument("--storage-options", default="{}", help="fsspec storage options as JSON, e.g. '{\"anon\": true}'")
    p.add_argument("--endpoint-url", help="S3 endpoint (shortcut for storage option client_kwargs.endpoint_url)")
    args = p.parse_args(argv)
    try:
        so = json.loads(args.storage_options)
    except json.JSONDecodeError as e:
        p.error(f"--storage-options is not JSON: {e}")
    if args.endpoint_url:
        so.setdefault("client_kwargs", {})["endpoint_url"] = args.endpoint_url
    try:
        result = write_report(args.runs, args.out, storage_options=so, baseline=args.baseline, title=args.title)
    except (ReportError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(markdown_table(result))
    print(f"\nwrote {Path(args.out) / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
