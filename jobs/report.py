"""Report of one or more job outputs (one per method): ``report.md`` + PNG plots.

    python jobs/report.py out/xsum-plain out/xsum-draft_model out/xsum-prompt_lookup --output reports/xsum
    python jobs/report.py s3://bucket/runs/plain s3://bucket/runs/draft --output reports/s3 \\
        --endpoint-url http://127.0.0.1:9000

Each argument is a job output directory (local or any fsspec URL, e.g. ``s3://``), read as
committed output: only the units its commit log commits (``pipeline.output.reader``); a run
that did not finish is reported on what it committed and named on stderr.  Writes
``<output>/report.md`` (table + plots), ``report.json`` and three PNGs; prints the table.  See pipeline/report.py for the definitions.  (``--out`` is a deprecated alias of
``--output``.)
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.imports import require_packages  # noqa: E402

require_packages("jobs/report.py")  # one line, exit 2, under a Python that lacks torch & co.

from pipeline.report import ReportError, markdown_table, write_report  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``jobs/report.py`` (flags: :mod:`pipeline.flags`)."""
    from pipeline.flags import build_parser as build_job_parser

    p = argparse.ArgumentParser(prog="jobs/report.py", description="Markdown + PNG report of specbatch run outputs.")
    p.add_argument("runs", nargs="+", metavar="RUN_OUTPUT_URI", help="job output directory (local, s3://, ...)")
    return build_job_parser("report", p.description, parser=p,
                            defaults={"output": "reports/latest", "baseline": "plain", "title": "specbatch run report",
                                      "storage_options": "{}"},
                            notes={"output": "a local folder: report.md, report.json and the PNGs"})


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        so = json.loads(args.storage_options)
    except json.JSONDecodeError as e:
        p.error(f"--storage-options is not JSON: {e}")
    if args.endpoint_url:
        so.setdefault("client_kwargs", {})["endpoint_url"] = args.endpoint_url
    try:
        result = write_report(args.runs, args.output, storage_options=so, baseline=args.baseline, title=args.title)
    except (ReportError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for d in result["runs"]:
        if not d["finished"]:
            print(f"note: {d['label']} did not finish: {d['output']}", file=sys.stderr)
    print(markdown_table(result))
    print(f"\nwrote {Path(args.output) / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
