"""Benchmark of the job at scale (not a test): what the pipeline costs as rows grow.

Synthetic corpora of short rows (10k, 100k and 1M by default) as one JSONL file and as many
files (``--rows-per-file``), run by the summarize job (``pipeline.cli.main``, what
``jobs/summarize.py`` runs) on an embedded Ray with the demo target, plain decoding,
``max_new_tokens=1``, one actor.  Two engines:

- ``demo``: the demo target (models/demo-target) decodes each row (its prefill dominates);
- ``stub``: **an engine stub** in the job's actor that returns one token per row at once,
  without running the model (the actor still loads the pair, builds and tokenizes every
  prompt, and the job reads, batches, writes and commits every row): the pipeline's own
  cost, which the demo model's prefill would hide.

For each corpus it prints, measured in one run each on the wall clock:

- the job's rows/s after its first output batch (the actor's start and model loading left
  out; also from the dataset start, ``generate_elapsed_s``, and end to end) against
  the engine alone on the same rows (in this process: prompts built and tokenized, then
  ``generate_batch`` on batches of ``compute.rows_per_batch`` rows, as the actor does);
- the pipeline's overhead per row and per unit: (job time after the first batch - engine-alone
  time) / rows, / units
  (a unit is what commits on its own: one record of the commit log under ``_manifest/log/``);
- the driver's peak RSS (``ru_maxrss`` of the process running the job) and the manifest's size;
- the time to resume a complete output (nothing to do) and a 99 %-complete one (the last 1 %
  of the units' manifest entries and files removed; a corpus of one unit cannot be 99 %
  complete and is marked so);
- on the single file: the rows lost to a SIGTERM sent once the job's progress bar shows half
  the rows done (rows done by then, from the bar, less the rows committed in the output);
- how each figure grows from the smallest to the largest corpus: the exponent
  log(f_large / f_small) / log(rows_large / rows_small) (1 = linear), flagged when
  super-linear (> 1.15), and the driver RSS growth in MB.

    python bench/bench_scale.py --output reports/bench_scale            # 10k, 100k, 1M rows
    python bench/bench_scale.py --sizes 10000,100000 --engines stub,demo --output reports/bench_scale
    python bench/bench_scale.py --quick --output /tmp/bench_scale       # 200 / 800 rows, the stub

``--split-rows N`` passes ``input.split_rows`` (work units smaller than a file) when this
version's config has that key.  Above ``--engine-alone-max-rows`` (100k) the engine alone is
timed on a corpus's first rows and scaled to its size (it costs the same per row: the table
says so); above ``--sigterm-max-rows`` (100k) no SIGTERM run is made, and above
``--many-max-rows`` (100k) only the single file runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEMO_CONFIG = REPO / "configs" / "demo-summarize.yaml"
STUB_LABEL = "engine stub (one token per row at once, no model forward: the pipeline's own cost)"
WORDS = ("the council met on monday and voted to build a new school near the river while farmers said the dry "
         "summer hurt their crops and prices rose again").split()
SUPERLINEAR = 1.15
#: seconds to wait before timing a resume: the job before it leaves Ray's processes exiting for
#: seconds (a complete 1M-row output resumed in 13.2 s right after its job, 8-9 s on its own)
SETTLE_S = 10
#: fewer units than this commit too close together for a rate after the first commit
MIN_UNITS_STEADY = 10


# ----------------------------------------------------------------------------- the engine stub
class StubEngine:
    """``generate_batch`` returning one token per row at once (no model forward)."""

    def __init__(self, token_id: int):
        self.token_id = token_id

    def generate_batch(self, prompts, settings):
        from pipeline.engine.stats import GenerationResult, RowStats

        return [GenerationResult(token_ids=[self.token_id], text=None, finish_reason="length",
                                 stats=RowStats(prompt_tokens=len(p), new_tokens=1, verify_steps=1, finish_reason="length"))
                for p in prompts]


def _stub_actor_class():
    from actors.generate import GenerateActor

    class StubEngineActor(GenerateActor):
        """The job's actor (model pair loaded, prompts built and tokenized as usual) with
        :class:`StubEngine` in place of its engine."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.engine = StubEngine(_token(self.models.tokenizer))

    return StubEngineActor


def _token(tokenizer) -> int:
    ids = tokenizer("the")["input_ids"]
    return int(ids[-1]) if ids else 0


# ----------------------------------------------------------------------------- the job, in a child process
def child_job(argv: list[str]) -> int:
    """``bench_scale.py _job STATS_FILE {stub,demo} -- <summarize flags>``: run the job in this
    process (``pipeline.cli.main``), then write its exit status and peak RSS to STATS_FILE."""
    stats_file, engine, rest = argv[0], argv[1], argv[3:]
    if engine == "stub":
        import actors.generate
        from ray import cloudpickle

        if __name__ != "__main__":  # classes of __main__ are pickled by value already
            cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors do not import bench/
        actors.generate.GenerateActor = _stub_actor_class()
    from pipeline.cli import main

    rc = main("summarize", rest, default_config=str(DEMO_CONFIG))
    Path(stats_file).write_text(json.dumps({"rc": rc, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
    return rc


def _has_key(section: str, key: str) -> bool:
    from pipeline import config

    cls = {n: f.annotation for n, f in config.JobConfig.model_fields.items()}.get(section)
    return cls is not None and key in getattr(cls, "model_fields", {})


def job_flags(corpus: Path, out: Path, args) -> list[str]:
    flags = ["--input", str(corpus), "--output", str(out), "--method", "plain", "--max-new-tokens", "1",
             "--num-actors", "1", "--rows-per-batch", str(args.rows_per_batch), "--audit-fraction", "0",
             "--set", "output.partition_by_date=false", "--set", "compute.cpus_per_actor=1"]
    if args.split_rows:
        if not _has_key("input", "split_rows"):
            raise SystemExit("--split-rows: this version's config has no input.split_rows")
        flags += ["--set", f"input.split_rows={args.split_rows}"]
    return flags


#: Ray's own start-up failure on an overloaded machine (it gives a new node 30 s to register)
RAY_START_TIMEOUT = "The current node timed out during startup"


def run_job(engine: str, flags: list[str], *, progress: bool = False, sigterm_at: float | None = None,
            timeout: float = 7200) -> dict:
    """Run the job in a child process: ``{"rc", "wall_s", "peak_rss_mb", "headline", "stderr",
    "done_at_signal"}``.  ``sigterm_at``: send SIGTERM once the progress bar shows this
    fraction of the rows done.  A run whose embedded Ray failed to start (:data:`RAY_START_TIMEOUT`)
    is run again, once, and says so."""
    got = _run_job(engine, flags, progress=progress, sigterm_at=sigterm_at, timeout=timeout)
    if got["rc"] == 1 and RAY_START_TIMEOUT in got["stderr"]:
        print("(the embedded Ray did not start in time on this loaded machine: the run is repeated)", flush=True)
        got = _run_job(engine, flags, progress=progress, sigterm_at=sigterm_at, timeout=timeout)
    return got


def _run_job(engine: str, flags: list[str], *, progress: bool, sigterm_at: float | None, timeout: float) -> dict:
    stats = Path(tempfile.mkstemp(prefix="bench-scale-", suffix=".json")[1])
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    cmd = [sys.executable, str(Path(__file__).resolve()), "_job", str(stats), engine, "--",
           *flags, *([] if progress else ["--no-progress"])]
    errfile = stats.with_suffix(".err")
    t0 = time.perf_counter()
    done_at_signal = None
    with open(errfile, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=REPO)
        try:
            if sigterm_at is not None:
                while proc.poll() is None:
                    done, total = _progress(errfile.read_text(errors="replace"))
                    if total and done >= sigterm_at * total:
                        proc.send_signal(signal.SIGTERM)
                        done_at_signal = done
                        break
                    time.sleep(0.05)
            stdout, _ = proc.communicate(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    wall = time.perf_counter() - t0
    text = errfile.read_text(errors="replace")
    errfile.unlink()
    got = json.loads(stats.read_text()) if stats.stat().st_size else {"rc": proc.returncode, "peak_rss_mb": None}
    stats.unlink()
    headline = None
    if "{" in stdout:
        try:
            headline = json.loads(stdout[stdout.index("{"):stdout.rindex("}") + 1])
        except ValueError:
            headline = None
    if done_at_signal is not None:
        done_at_signal = max(done_at_signal, _progress(text)[0])  # the bar's last count before the interrupt
    return {"rc": proc.returncode, "wall_s": wall, "peak_rss_mb": got.get("peak_rss_mb"), "headline": headline,
            "stderr": text[-3000:], "done_at_signal": done_at_signal}


#: the job's own bar (pipeline.run: ``rows done``), not another tqdm bar (a checkpoint's loading)
_BAR = re.compile(r"rows done:[^\r\n]*?(\d+)/(\d+) \[")


def _progress(text: str) -> tuple[int, int]:
    """The last ``done/total`` of the job's progress bar (tqdm on stderr)."""
    found = _BAR.findall(text[-4000:].split("interrupted (")[0])
    return (int(found[-1][0]), int(found[-1][1])) if found else (0, 0)


# ----------------------------------------------------------------------------- the output
def log_records(out: Path) -> list[tuple[Path, object]]:
    """The output's commit log (``_manifest/log/``): ``(path, record)`` in order, each
    decoded (:func:`pipeline.output.records.decode_log_record`)."""
    from pipeline.output.records import decode_log_record

    return [(p, decode_log_record(int(p.stem), json.loads(p.read_text())))
            for p in sorted((out / "_manifest" / "log").glob("*.json"))]


def manifest_entries(out: Path) -> list:
    """The committed units: the ``unit`` records of the commit log."""
    return [r for _, r in log_records(out) if r.kind == "unit"]


def manifest_bytes(out: Path) -> int:
    return sum(p.stat().st_size for p in (out / "_manifest").rglob("*") if p.is_file())


def committed_rows(out: Path) -> int:
    """Rows in the output's committed Parquet files (names not starting with ``_``)."""
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(p).metadata.num_rows for p in out.glob("*.parquet") if not p.name.startswith("_"))


def make_99_percent(out: Path) -> int:
    """Remove the last 1 % of the committed units (the last records of the commit log, the
    run's ``final`` one first, and the data files they name), and ``_SUCCESS`` /
    ``_summary.json``: a 99 %-complete output.  Returns the rows removed (0 when the output
    has a single unit)."""
    records = log_records(out)
    units = [r for _, r in records if r.kind == "unit"]
    if len(units) < 2:
        return 0
    while records and records[-1][1].kind == "final":
        records.pop()[0].unlink()
    removed = 0
    for _ in range(max(1, math.ceil(len(units) / 100))):
        path, data = records.pop()  # the tail of the log: the last units committed
        if data.kind == "unit":  # (an epoch of a resumed run names no file)
            for name in data.files:
                (out / name).unlink()
            removed += data.rows or 0
        path.unlink()
    for name in ("_SUCCESS", "_summary.json"):
        (out / name).unlink(missing_ok=True)
    return removed


# ----------------------------------------------------------------------------- the corpora
def make_corpus(root: Path, rows: int, rows_per_file: int | None) -> Path:
    """``rows`` short rows (about 14 words) as one JSONL file, or files of ``rows_per_file`` rows."""
    folder = root / (f"{rows}-one-file" if rows_per_file is None else f"{rows}-files-of-{rows_per_file}")
    if folder.exists():
        return folder
    folder.mkdir(parents=True)
    per = rows if rows_per_file is None else rows_per_file
    for f in range(math.ceil(rows / per)):
        with open(folder / f"part-{f:05d}.jsonl", "w") as fh:
            for i in range(f * per, min(rows, (f + 1) * per)):
                words = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(12))
                fh.write(json.dumps({"id": i, "text": f"row {i}: {words}"}) + "\n")
    return folder


def corpus_texts(corpus: Path) -> list[str]:
    return [json.loads(line)["text"] for p in sorted(corpus.glob("*.jsonl")) for line in p.open()]


# ----------------------------------------------------------------------------- the engine alone
def engine_alone(engine: str, texts: list[str], args) -> float:
    """Seconds the engine alone takes on ``texts``, as the actor feeds it: prompts built
    and tokenized, ``generate_batch`` on batches of ``rows_per_batch`` rows (models loaded first)."""
    import torch

    from pipeline.config import load_config
    from pipeline.loading import load_engine
    from pipeline.prompts import PromptBuilder

    torch.set_num_threads(1)  # one actor of one CPU
    cfg = load_config(DEMO_CONFIG, ["method.name=plain", "generation.max_new_tokens=1",
                                    f"compute.rows_per_batch={args.rows_per_batch}"])
    loaded = load_engine(cfg, "cpu", cfg.compute.max_batch_size)
    builder = PromptBuilder(loaded.models.tokenizer, cfg.task)
    eng = StubEngine(_token(loaded.models.tokenizer)) if engine == "stub" else loaded.engine
    batch = cfg.compute.rows_per_batch
    eng.generate_batch([builder.build(texts[0])[1]], [loaded.settings])  # warm-up
    t0 = time.perf_counter()
    for i in range(0, len(texts), batch):
        prompts = [builder.build(t)[1] for t in texts[i:i + batch]]
        eng.generate_batch(prompts, [loaded.settings] * len(prompts))
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------- one corpus
def bench_corpus(engine: str, rows: int, rows_per_file: int | None, work: Path, args) -> dict:
    layout = "one file" if rows_per_file is None else f"files of {rows_per_file} rows"
    corpus = make_corpus(work / "corpora", rows, rows_per_file)
    out = work / "out" / f"{engine}-{corpus.name}"
    shutil.rmtree(out, ignore_errors=True)
    flags = job_flags(corpus, out, args)
    r: dict = {"engine": engine, "rows": rows, "layout": layout, "files": len(list(corpus.glob("*.jsonl")))}
    print(f"\n== {engine}, {rows:,} rows, {layout}", flush=True)

    job = run_job(engine, flags)
    if job["rc"] != 0 or not job["headline"]:
        raise RuntimeError(f"the job failed (exit {job['rc']}):\n{job['stderr']}")
    summary = json.loads((out / "_summary.json").read_text())
    assert summary["rows"] == rows, (summary["rows"], rows)
    units = len(manifest_entries(out))
    gen = summary["generate_elapsed_s"]
    r.update(units=units, job_wall_s=job["wall_s"], job_elapsed_s=summary["elapsed_s"], generate_elapsed_s=gen,
             first_batch_s=summary.get("first_batch_s"), driver_peak_rss_mb=job["peak_rss_mb"],
             manifest_bytes=manifest_bytes(out))
    texts = corpus_texts(corpus)
    sample = min(rows, args.engine_alone_max_rows)
    # the engine alone costs the same per row at any size: above --engine-alone-max-rows it is
    # measured on the first rows and scaled to the corpus (said in the table)
    eng_s = engine_alone(engine, texts[:sample], args) * rows / sample
    del texts
    r["engine_alone_s"], r["engine_alone_rows"] = eng_s, sample
    r["engine_rows_per_s"] = rows / eng_s
    # steady state: from the first output batch on (the actor's start and model loading left out;
    # the first batch's rows are counted in, so this rate errs high by one batch of rows)
    steady = max(gen - (summary.get("first_batch_s") or 0.0), 1e-9)
    r["job_steady_s"] = steady
    r["job_rows_per_s"] = rows / steady
    r["job_rows_per_s_from_start"] = rows / gen
    r["job_rows_per_s_end_to_end"] = rows / summary["elapsed_s"]
    r["job_vs_engine"] = r["job_rows_per_s"] / r["engine_rows_per_s"]
    r["overhead_per_row_ms"] = (steady - eng_s) / rows * 1e3
    r["overhead_per_unit_s"] = (steady - eng_s) / units
    print(f"job {r['job_rows_per_s']:,.0f} rows/s after the first batch ({r['job_rows_per_s_from_start']:,.0f} from the "
          f"dataset start, first batch at {summary.get('first_batch_s') or 0:.1f} s; "
          f"{r['job_rows_per_s_end_to_end']:,.0f} end to end), engine alone "
          f"{r['engine_rows_per_s']:,.0f} rows/s: {r['job_vs_engine']:.2f}x; overhead {r['overhead_per_row_ms']:.3f} ms/row, "
          f"{r['overhead_per_unit_s']:.3f} s/unit ({units} units); driver peak RSS {r['driver_peak_rss_mb']:.0f} MB; "
          f"manifest {r['manifest_bytes'] / 1024:.1f} KiB", flush=True)

    time.sleep(args.settle_s)  # the last job's Ray processes finish exiting before a resume is timed
    again = run_job(engine, flags)
    assert again["rc"] == 0 and again["headline"]["this_run"]["nothing_to_do"], again["stderr"]
    r["resume_complete_s"] = again["wall_s"]
    removed = make_99_percent(out)
    if removed:
        time.sleep(args.settle_s)
        part = run_job(engine, flags)
        assert part["rc"] == 0 and part["headline"]["rows"] == rows, part["stderr"]
        r["resume_99_s"], r["resume_99_rows_redone"] = part["wall_s"], removed
    else:
        r["resume_99_s"], r["resume_99_rows_redone"] = None, None
    print(f"resume: complete {r['resume_complete_s']:.1f} s; 99 % complete "
          + (f"{r['resume_99_s']:.1f} s ({removed} rows redone)" if removed else "n/a (one unit)"), flush=True)

    if rows_per_file is None and rows <= args.sigterm_max_rows:  # a SIGTERM in the middle of a single-file run
        shutil.rmtree(out)
        hit = run_job(engine, flags, progress=True, sigterm_at=0.5)
        kept = committed_rows(out) if out.exists() else 0
        done = hit["done_at_signal"] or 0
        r.update(sigterm_rc=hit["rc"], sigterm_rows_done=done, sigterm_rows_committed=kept,
                 sigterm_rows_lost=max(0, done - kept), sigterm_units_committed=len(manifest_entries(out)) if out.exists() else 0)
        print(f"SIGTERM at {done:,} of {rows:,} rows done: exit {hit['rc']}, {kept:,} rows committed, "
              f"{r['sigterm_rows_lost']:,} rows lost", flush=True)
    shutil.rmtree(out, ignore_errors=True)
    return r


# ----------------------------------------------------------------------------- growth and goals
GROWTH = (("generate_elapsed_s", "job time (from the dataset start)"), ("engine_alone_s", "engine alone"),
          ("manifest_bytes", "manifest size"), ("resume_complete_s", "resume, complete output"),
          ("resume_99_s", "resume, 99 % complete"))


def growth(runs: list[dict]) -> list[dict]:
    """Per (engine, layout): each figure's growth from the smallest to the largest corpus."""
    out = []
    for key in sorted({(r["engine"], r["layout"]) for r in runs}):
        rs = sorted((r for r in runs if (r["engine"], r["layout"]) == key), key=lambda r: r["rows"])
        if len(rs) < 2:
            continue
        a, b = rs[0], rs[-1]
        scale = b["rows"] / a["rows"]
        g = {"engine": key[0], "layout": key[1], "from_rows": a["rows"], "to_rows": b["rows"], "rows_ratio": scale,
             "figures": {}}
        for name, _ in GROWTH:
            if a.get(name) and b.get(name):
                ratio = b[name] / a[name]
                exp = math.log(ratio) / math.log(scale)
                g["figures"][name] = {"ratio": ratio, "exponent": exp, "superlinear": exp > SUPERLINEAR}
        if a.get("driver_peak_rss_mb") and b.get("driver_peak_rss_mb"):
            g["driver_rss_growth_mb"] = b["driver_peak_rss_mb"] - a["driver_peak_rss_mb"]
        g["marginal"] = marginal(rs)
        out.append(g)
    return out


def marginal(rs: list[dict]) -> list[dict]:
    """The job's marginal rate between consecutive sizes of one engine and layout: extra rows
    over extra time from the dataset start (``generate_elapsed_s``), so the costs every run
    pays once (Ray's start, the actor's start and model loading) cancel, against the engine
    alone's rate on the larger corpus."""
    out = []
    for a, b in zip(rs, rs[1:]):
        dt = b["generate_elapsed_s"] - a["generate_elapsed_s"]
        if dt <= 0:
            continue
        rate = (b["rows"] - a["rows"]) / dt
        out.append({"from_rows": a["rows"], "to_rows": b["rows"], "job_rows_per_s": rate,
                    "engine_rows_per_s": b["engine_rows_per_s"], "job_vs_engine": rate / b["engine_rows_per_s"]})
    return out


def goals(runs: list[dict]) -> list[str]:
    lines = []
    at100k = [r for r in runs if r["rows"] == 100_000 and r["engine"] == "demo"]
    for r in at100k:
        lines.append(f"job rows/s at 100k ({r['layout']}, demo target) / engine alone: {r['job_vs_engine']:.2f} "
                     f"(goal >= 0.9: {'met' if r['job_vs_engine'] >= 0.9 else 'missed'})")
    if not at100k:
        demo = sorted({r["rows"] for r in runs if r["engine"] == "demo"})
        lines.append("job rows/s at 100k against the demo engine alone: not measured ("
                     + (f"the demo target was run at {', '.join(f'{n:,}' for n in demo)} rows" if demo
                        else "the demo target was not run") + ")")
        for r in runs:
            if r["rows"] == 100_000 and r["engine"] == "stub":
                lines.append(f"job rows/s at 100k ({r['layout']}) / the engine stub alone: "
                             f"{r['job_rows_per_s_from_start'] / r['engine_rows_per_s']:.2f} from the dataset start "
                             "(Ray's start, the actor's start and model loading included)"
                             + (f", {r['job_vs_engine']:.2f} after the first commit"
                                if r["units"] >= MIN_UNITS_STEADY else ""))
    for g in growth(runs):
        for m in g["marginal"]:
            if m["to_rows"] == 100_000:
                lines.append(f"job rows/s from {m['from_rows']:,} to 100,000 rows (marginal; {g['engine']}, {g['layout']}) "
                             f"/ engine alone: {m['job_vs_engine']:.2f} (goal >= 0.9: "
                             f"{'met' if m['job_vs_engine'] >= 0.9 else 'missed'})")
    for g in growth(runs):
        if "driver_rss_growth_mb" in g:
            lines.append(f"driver RSS growth {g['from_rows']:,} -> {g['to_rows']:,} rows ({g['engine']}, {g['layout']}): "
                         f"{g['driver_rss_growth_mb']:+.0f} MB (goal <= 50 MB from 10k to 1M)")
    big = max((r["rows"] for r in runs), default=0)
    for r in runs:
        if r["rows"] == big:
            lines.append(f"resume of a complete {big:,}-row output ({r['engine']}, {r['layout']}): "
                         f"{r['resume_complete_s']:.1f} s (goal <= 10 s at 1M rows)")
    for r in runs:
        if "sigterm_rows_lost" in r:
            lines.append(f"SIGTERM in a single-file run of {r['rows']:,} rows ({r['engine']}): {r['sigterm_rows_lost']:,} of "
                         f"{r['sigterm_rows_done']:,} rows done were lost, {r['sigterm_units_committed']} unit(s) committed "
                         "(goal: at most the units in flight)")
    return lines


def table(runs: list[dict]) -> str:
    head = ("| engine | rows | layout | units | job rows/s from the start (after the first commit) | engine alone rows/s | job / engine | overhead ms/row (from the start) | "
            "overhead s/unit (from the start) | driver peak RSS MB | manifest KiB | resume complete s | resume 99 % s | SIGTERM: rows lost / done |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in runs:
        sig = f"{r['sigterm_rows_lost']:,} / {r['sigterm_rows_done']:,}" if "sigterm_rows_lost" in r else "–"
        res99 = f"{r['resume_99_s']:.1f}" if r.get("resume_99_s") is not None else "– (one unit)"
        alone = f"{r['engine_rows_per_s']:,.0f}" + (f" (first {r['engine_alone_rows']:,} rows)"
                                                   if r.get("engine_alone_rows", r["rows"]) < r["rows"] else "")
        steady = r["units"] >= MIN_UNITS_STEADY
        after = f"{r['job_rows_per_s']:,.0f}" if steady else "–"
        ratio = f"{r['job_rows_per_s_from_start'] / r['engine_rows_per_s']:.2f}" + (
            f" ({r['job_vs_engine']:.2f})" if steady else "")
        over = r["generate_elapsed_s"] - r["engine_alone_s"]  # from the start: Ray's and the actor's start included
        lines.append(f"| {r['engine']} | {r['rows']:,} | {r['layout']} | {r['units']} | "
                     f"{r['job_rows_per_s_from_start']:,.0f} ({after}) | "
                     f"{alone} | {ratio} | {over * 1e3 / r['rows']:.3f} | "
                     f"{over / r['units']:.3f} | {r['driver_peak_rss_mb']:.0f} | {r['manifest_bytes'] / 1024:.1f} | "
                     f"{r['resume_complete_s']:.1f} | {res99} | {sig} |")
    return "\n".join(lines)


def growth_lines(runs: list[dict]) -> list[str]:
    lines = []
    for g in growth(runs):
        for m in g["marginal"]:
            lines.append(f"{g['engine']}, {g['layout']}, marginal rate {m['from_rows']:,} -> {m['to_rows']:,} rows: "
                         f"{m['job_rows_per_s']:,.0f} rows/s against the engine alone's {m['engine_rows_per_s']:,.0f} "
                         f"({m['job_vs_engine']:.2f}x)")
    for g in growth(runs):
        parts = [f"{label} x{g['figures'][k]['ratio']:.2f} (exponent {g['figures'][k]['exponent']:.2f}"
                 + (", SUPER-LINEAR" if g["figures"][k]["superlinear"] else "") + ")"
                 for k, label in GROWTH if k in g["figures"]]
        rss = f"; driver RSS {g['driver_rss_growth_mb']:+.0f} MB" if "driver_rss_growth_mb" in g else ""
        lines.append(f"{g['engine']}, {g['layout']}, {g['from_rows']:,} -> {g['to_rows']:,} rows (x{g['rows_ratio']:.0f}): "
                     + "; ".join(parts) + rss)
    return lines


def _commit() -> str | None:
    try:
        sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def _machine() -> str:
    import platform

    load = os.getloadavg()[0]
    return f"{platform.machine()}, {os.cpu_count()} cores, load average {load:.1f} at the start"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_job"]:
        return child_job(argv[1:])
    if argv[:1] == ["--from-runs"]:  # --from-runs FILE [--output DIR] --meta JSON
        rest = dict(zip(argv[2::2], argv[3::2]))
        return report_from_runs(argv[1], rest.get("--output"), rest.get("--meta", "{}"))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="10000,100000,1000000", help="corpus sizes in rows, comma-separated")
    p.add_argument("--engines", default="stub,demo", help="stub and/or demo")
    p.add_argument("--layouts", default="one,many", help="one (one file) and/or many (files of --rows-per-file rows)")
    p.add_argument("--rows-per-file", type=int, default=1000)
    p.add_argument("--rows-per-batch", type=int, default=256, help="compute.rows_per_batch (rows per actor call)")
    p.add_argument("--split-rows", type=int, default=None, help="input.split_rows, where this version has it")
    p.add_argument("--engine-alone-max-rows", type=int, default=100_000,
                   help="time the engine alone on at most this many rows of a corpus, scaled to its size")
    p.add_argument("--many-max-rows", type=int, default=100_000,
                   help="run the many-files layout only up to this many rows")
    p.add_argument("--sigterm-max-rows", type=int, default=100_000,
                   help="send the mid-run SIGTERM only to single files of at most this many rows")
    p.add_argument("--demo-max-rows", type=int, default=100_000, help="run the demo target only up to this size")
    p.add_argument("--quick", action="store_true", help="200 and 800 rows, the stub, files of 200 rows, units of 100 rows, 32 rows per batch, the SIGTERM at 200 rows only (minutes: a Ray start per job run)")
    p.add_argument("--output", default=None, help="write report.json and report.md here")
    p.add_argument("--work", default=None, help="folder for corpora and outputs (default: a temporary one)")
    args = p.parse_args(argv)
    args.settle_s = SETTLE_S
    if args.quick:
        args.sizes, args.engines, args.rows_per_file, args.rows_per_batch = "200,800", "stub", 200, 32
        args.settle_s, args.sigterm_max_rows = 0, 200  # (figures that mean nothing at this size: fewer Ray starts)
        if args.split_rows is None and _has_key("input", "split_rows"):
            args.split_rows = 100  # several units per file: the SIGTERM half-way lands between unit commits
    sizes = [int(s) for s in args.sizes.split(",")]
    engines = args.engines.split(",")
    layouts = [None if lay == "one" else args.rows_per_file for lay in args.layouts.split(",")]
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench-scale-"))
    meta = {"command": "python bench/bench_scale.py " + " ".join(argv), "commit": _commit(), "machine": _machine(),
            "config": "configs/demo-summarize.yaml: plain, max_new_tokens=1, 1 actor of 1 CPU, embedded Ray, "
                      f"rows_per_batch={args.rows_per_batch}", "stub": STUB_LABEL, "clock": "wall",
            "split_rows": args.split_rows}
    runs = []
    if "stub" in engines:
        print(f"stub = {STUB_LABEL}", flush=True)
    try:
        for engine in engines:
            for rows in sizes:
                if engine == "demo" and rows > args.demo_max_rows:
                    continue
                for rpf in layouts:
                    if rpf is not None and rows > args.many_max_rows:
                        continue
                    runs.append(bench_corpus(engine, rows, rpf, work, args))
                    if args.output:  # each corpus's figures as soon as they are measured
                        Path(args.output).mkdir(parents=True, exist_ok=True)
                        (Path(args.output) / "runs.partial.json").write_text(json.dumps(runs, indent=1))
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    write_report(runs, meta, args.output)
    return 0


def write_report(runs: list[dict], meta: dict, output: str | None) -> None:
    """Print the table, the growth and the goals; write report.json and report.md to ``output``."""
    print("\n" + table(runs))
    if any(r["engine"] == "stub" for r in runs):
        print(f"stub = {STUB_LABEL}")
    print("\n".join(growth_lines(runs) + goals(runs)))
    if not output:
        return
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "runs.partial.json").unlink(missing_ok=True)
    sizes = sorted({r["rows"] for r in runs})
    engines = " and ".join({"stub": "an engine stub", "demo": "the demo target"}[e] for e in dict.fromkeys(r["engine"] for r in runs))
    title = (f"bench/bench_scale.py: the job on {', '.join(f'{s:,}' for s in sizes)} short rows, one file and many, "
             f"plain, 1 new token, {engines} ({meta['machine'].split(', load')[0]})")
    marg = [(g, m) for g in growth(runs) for m in g["marginal"]]
    summary = (["job / engine alone, marginal rate between sizes (the fixed start cancels) "
                + ", ".join(f"{m['job_vs_engine']:.2f} ({g['engine']}, {g['layout']}, {m['from_rows'] // 1000}k -> "
                            f"{m['to_rows'] // 1000}k)" for g, m in marg)] if marg else [])
    summary += [f"driver RSS {g['driver_rss_growth_mb']:+.0f} MB from {g['from_rows'] // 1000}k to {g['to_rows'] // 1000}k rows "
                f"({g['engine']}, {g['layout']})" for g in growth(runs) if "driver_rss_growth_mb" in g]
    summary += [f"a complete {r['rows'] // 1000}k-row output ({r['engine']}, {r['layout']}) resumed in {r['resume_complete_s']:.1f} s"
                for r in runs if r["rows"] == max(sizes)]
    summary += [f"a SIGTERM half-way through one file of {r['rows'] // 1000}k rows ({r['engine']}) kept "
                f"{r['sigterm_units_committed']} committed unit(s), {r['sigterm_rows_committed']:,} rows"
                for r in runs if "sigterm_rows_lost" in r and r["rows"] == max(x["rows"] for x in runs if "sigterm_rows_lost" in x)]
    (out / "report.json").write_text(json.dumps({"title": title, "meta": meta, "runs": runs, "growth": growth(runs),
                                                 "goals": goals(runs), "summary": summary}, indent=1))
    (out / "report.md").write_text(
        f"# {title}\n\n`{meta['command']}` at {meta['commit']} on {meta['machine']}; {meta['config']}.\n\n"
        + (f"{meta['note']}\n\n" if meta.get("note") else "")
        + f"**stub** = {STUB_LABEL}.\n\n{table(runs)}\n\n## Growth\n\n" + "\n".join(f"- {ln}" for ln in growth_lines(runs))
        + "\n\n## Goals (issue 26)\n\n" + "\n".join(f"- {ln}" for ln in goals(runs)) + "\n")


def report_from_runs(path: str, output: str | None, meta_json: str) -> int:
    """``--from-runs runs.partial.json``: the report of the corpora an interrupted run measured
    (``--meta`` gives the run's command, commit, machine and a note, as JSON)."""
    data = json.loads(Path(path).read_text())
    runs = data["runs"] if isinstance(data, dict) else data
    meta = {"config": "configs/demo-summarize.yaml: plain, max_new_tokens=1, 1 actor of 1 CPU, embedded Ray",
            "stub": STUB_LABEL, "clock": "wall", **json.loads(meta_json)}
    write_report(runs, meta, output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
