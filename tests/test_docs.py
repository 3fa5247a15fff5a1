"""The documentation stays true to the tree: the README's size, every link and file path the
pages name, every fenced command block either run by a test or marked as not run, every job
command line resolving with its job's own parser (and ``--print-config``), and every
generated part (the README's results block, the reports' index, the configuration page, the
flag and method tables) equal to what its script generates now.

The pages: README.md, docs/*.md and reports/README.md.  The convention for command blocks
(``bash``, ``sh``, ``shell``, ``console``, ``cron``, ``python``): the line right before the
opening fence is an HTML comment, either ``<!-- run by: <runner>[, <runner> ...] (notes) -->``,
each runner being ``.ci/run`` or a test file, optionally with ``::test_name``, or
``<!-- not run: <reason> -->``.  A few seconds in all: nothing here starts Ray or loads a model.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import io
import re
import shlex
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md")), REPO / "reports" / "README.md"]
COMMAND_LANGS = {"bash", "sh", "shell", "console", "cron", "python"}
README_LIMIT = 12_000
#: top-level folders whose paths, named in a page's inline code, must exist
TREE_ROOTS = ("actors", "bench", "configs", "data", "deploy", "docs", "examples", "jobs", "models", "pipeline",
              "reports", "scripts", "tests", "train")
#: paths the jobs and scripts create (git-ignored): named in the pages, absent from a clone
GENERATED = ("models/cache", "out/")

FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```\s*$", re.S | re.M)
MARKER = re.compile(r"<!--\s*(run by|not run):\s*(.*?)\s*-->\s*$", re.S)
RUNNER = re.compile(r"(\.ci/run|tests/[\w/]+\.py)(?:::(\w+))?")


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rel(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


def blocks(page: Path) -> list[tuple[str, str, str | None, int]]:
    """``(language, body, the marker comment before it or None, line)`` of each fenced block."""
    text = page.read_text(encoding="utf-8")
    out = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = before if MARKER.search(before) else None
        out.append((m.group(1), m.group(2), marker, text[: m.start()].count("\n") + 1))
    return out


def prose(page: Path) -> str:
    """The page without its fenced blocks."""
    return FENCE.sub("", page.read_text(encoding="utf-8"))


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings."""
    out = set()
    for line in prose(page).splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            title = re.sub(r"[^\w\- ]", "", title.replace("`", ""))
            out.add(title.replace(" ", "-"))
    return out


# ---------------------------------------------------------------------------- the README
def test_the_readme_is_at_most_12000_characters():
    n = len(README.read_text(encoding="utf-8"))
    assert n <= README_LIMIT, f"README.md has {n} characters, more than {README_LIMIT}: move text into docs/"


def test_the_readme_test_command_is_what_ci_runs():
    ci = [ln.strip() for ln in (REPO / ".ci" / "run").read_text().splitlines() if ln.strip()]
    assert ci[-1] == "python -m pytest" and "bash scripts/setup.sh" in ci and ". .venv/bin/activate" in ci
    commands = [body.strip() for lang, body, _, _ in blocks(README) if lang == "bash"]
    assert ".venv/bin/python -m pytest" in commands  # the venv's python: what .ci/run's activated `python` is
    assert "bash scripts/setup.sh && .venv/bin/python jobs/summarize.py" in commands


# ---------------------------------------------------------------------------- links and paths
def _links(page: Path) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", prose(page))


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_link_exists(page):
    missing = []
    for target in _links(page):
        if re.match(r"^[a-z]+://|^mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            missing.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            missing.append(f"{target} (no such heading)")
    assert not missing, f"{_rel(page)} links to what does not exist: {missing}"


def _code_paths(page: Path) -> list[str]:
    spans = re.findall(r"`([^`\n]+)`", prose(page))
    out = []
    for span in spans:
        span = span.strip()
        if not re.match(rf"^({'|'.join(TREE_ROOTS)})/", span) or span.startswith(GENERATED):
            continue
        if re.search(r"[\s<>{}$]", span):  # a command line, a placeholder, a template
            continue
        out.append(span)
    return out


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_file_path_named_exists(page):
    missing = []
    for span in _code_paths(page):
        path, _, func = span.partition("::")
        hits = list(REPO.glob(path)) if "*" in path else [REPO / path]
        if not any(h.exists() for h in hits):
            missing.append(span)
        elif func and not re.search(rf"^(async )?def {re.escape(func)}\b", hits[0].read_text(), re.M):
            missing.append(f"{span} (no such test)")
    assert not missing, f"{_rel(page)} names paths that do not exist: {missing}"


# ---------------------------------------------------------------------------- command blocks
def _command_blocks():
    for page in PAGES:
        for lang, body, marker, line in blocks(page):
            if lang in COMMAND_LANGS:
                yield page, lang, body, marker, line


def test_every_command_block_is_run_by_a_test_or_marked_not_run():
    unmarked, bad = [], []
    for page, lang, body, marker, line in _command_blocks():
        where = f"{_rel(page)}:{line}"
        if marker is None:
            unmarked.append(where)
            continue
        kind, text = MARKER.search(marker).groups()
        if kind == "not run":
            if not text:
                bad.append(f"{where}: 'not run' without a reason")
            continue
        runners = RUNNER.findall(text)
        if not runners:
            bad.append(f"{where}: 'run by' names no test")
        for path, func in runners:
            file = REPO / path
            if not file.is_file():
                bad.append(f"{where}: {path} does not exist")
            elif func and not re.search(rf"^(async )?def {func}\b", file.read_text(), re.M):
                bad.append(f"{where}: {path} has no {func}")
    assert not unmarked, ("command blocks without '<!-- run by: ... -->' or '<!-- not run: ... -->' right before "
                          f"them: {unmarked}")
    assert not bad, bad


def _shell_lines(body: str) -> list[str]:
    """The block's command lines: continuations joined, ``for x in a b; do`` variables and
    ``$PWD`` resolved, ``$(date ...)`` given a date."""
    body = re.sub(r"\\\n\s*", " ", body)
    loops = dict(re.findall(r"for (\w+) in (\S+)[^;\n]*; do", body))
    out = []
    for line in body.splitlines():
        line = re.sub(r'"?\$\(date [^)]*\)"?', datetime.date.today().isoformat(), line)
        line = line.replace("$PWD", str(REPO))
        for var, first in loops.items():
            line = line.replace(f"${var}", first)
        out.append(line)
    return out


def _job_invocations(lang: str, body: str) -> list[tuple[str, list[str]]]:
    """``(job, args)`` of every ``python jobs/<job>.py ...`` in a shell block, and
    ``("serve run", args)`` of every ``serve run pipeline.serve:app_builder ...``."""
    if lang == "python":
        return []
    found = []
    for line in _shell_lines(body):
        try:
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            lexer.commenters = "#"
            tokens = list(lexer)
        except ValueError:
            continue
        for i, tok in enumerate(tokens):
            job = re.search(r"(?:^|/)jobs/(\w+)\.py$", tok)
            serve = tok == "serve" and tokens[i + 1: i + 3] == ["run", "pipeline.serve:app_builder"]
            if not (job or serve):
                continue
            start = i + 1 if job else i + 3
            args = []
            for t in tokens[start:]:
                if re.fullmatch(r"[;&|<>()]+|\d?>&?\d*", t):
                    break
                args.append(t)
            found.append((job.group(1) if job else "serve run", args))
    return found


def _resolve(job: str, args: list[str], monkeypatch) -> tuple[int, str]:
    """Run ``job``'s own parser on ``args`` and, where the job has it, ``--print-config``.
    Returns ``(status, output)``."""
    monkeypatch.chdir(REPO)
    unresolved = [a for a in args if "$" in a or ("<" in a and ">" in a)]
    if unresolved:
        return 1, f"unresolved shell words {unresolved}"
    produced = [a for a in args if a.startswith("out/") and a.endswith((".yaml", ".yml")) and not (REPO / a).exists()]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            if job == "serve run":
                from pipeline.config import load_config

                kv = dict(a.split("=", 1) for a in args)
                load_config(kv.pop("config", None), [f"{k}={v}" for k, v in kv.items()])
                return 0, ""
            if job in ("summarize", "translate", "generate") and not produced:
                from pipeline.cli import main

                return main(job, [*args, "--print-config"]), out.getvalue()
            if job == "serve":
                from pipeline.serve.app import main

                return main([*args, "--print-config"]), out.getvalue()
            if job in ("summarize", "translate", "generate"):
                from pipeline.cli import REPO_ROOT, build_parser

                build_parser(job, str(REPO_ROOT / "configs" / f"{job}.yaml")).parse_args(args)
                return 0, ""
            module = _load(REPO / "jobs" / f"{job}.py", f"docs_job_{job}")
            module.build_parser().parse_args(args)
            return 0, ""
        except SystemExit as e:
            return int(e.code or 0), out.getvalue()
        except Exception as e:  # noqa: BLE001 - reported with the command
            return 1, f"{type(e).__name__}: {e}"


def test_job_commands_in_the_docs_resolve(monkeypatch):
    """Every ``python jobs/<job>.py ...`` line of every command block (marked run or not): its
    flags parse with the job's own parser and, for summarize, translate, generate and serve, the config
    it names resolves (``--print-config``); ``serve run`` lines load their config."""
    seen, failed = 0, []
    for page, lang, body, _, line in _command_blocks():
        for job, args in _job_invocations(lang, body):
            seen += 1
            status, output = _resolve(job, args, monkeypatch)
            if status != 0:
                failed.append(f"{_rel(page)}:{line}: jobs/{job}.py {' '.join(args)}: {output.strip()[-300:]}")
    assert seen >= 10, f"found only {seen} job command lines: is the parser of the blocks broken?"
    assert not failed, "\n".join(failed)


def test_the_new_method_of_the_docs_is_the_one_the_test_runs():
    """Every code block of the page on adding a method is the toy method that
    tests/engine/test_adding_a_method.py builds and runs (none is an unchecked copy)."""
    page = REPO / "docs" / "adding-a-method.md"
    python = [(marker or "", line) for lang, _, marker, line in blocks(page) if lang == "python"]
    assert len(python) == 3, python  # the file, the registry line, its tests
    stray = [line for marker, line in python if "run by: tests/engine/test_adding_a_method.py::" not in marker]
    assert not stray, f"{_rel(page)}: blocks at lines {stray} are not run by tests/engine/test_adding_a_method.py"


# ---------------------------------------------------------------------------- generated parts
def test_the_results_block_and_the_reports_index_are_generated():
    rb = _load(REPO / "scripts" / "results_block.py", "docs_results_block")
    text = README.read_text(encoding="utf-8")
    assert rb.render(text) == text, "README.md's results block is stale: run python scripts/results_block.py"
    index = rb.INDEX.read_text(encoding="utf-8")
    assert rb.render_index(index) == index, "reports/README.md's index is stale: run python scripts/results_block.py"


def test_the_results_block_copes_with_a_new_report_folder(tmp_path):
    """A folder added under reports/ (a bench_real report, an unknown shape) gets its line."""
    import json

    rb = _load(REPO / "scripts" / "results_block.py", "docs_results_block")
    reports = tmp_path / "reports"
    (reports / "bench_real").mkdir(parents=True)
    (reports / "bench_real" / "report.json").write_text(json.dumps({
        "meta": {"command": "python bench/bench_real.py", "machine": "x86_64, 2 cores", "commit": "abc1234"},
        "runs": {"plain": {}}, "summary": ["best speculative / plain at 1 row: 1.31×"]}))
    (reports / "bench_real" / "report.md").write_text("# bench_real\n")
    (reports / "odd").mkdir()
    (reports / "odd" / "report.json").write_text('{"something": "else"}')
    (reports / "broken").mkdir()
    (reports / "broken" / "report.json").write_text("not json")
    (reports / "bench_interleaved" / "batch1").mkdir(parents=True)  # a diagnostic: the index only
    (reports / "bench_interleaved" / "batch1" / "report.json").write_text(json.dumps({
        "title": "bench/bench_interleaved.py: an A/B", "meta": {"commit": "def5678"}, "runs": {}, "summary": ["x"]}))
    for sub, commit in (("real/smollm2-xsum", "0ld0001"), ("real/gemma3-new", "fe5h001")):  # a path below a folder
        (reports / sub).mkdir(parents=True)
        (reports / sub / "report.json").write_text(json.dumps({
            "title": f"{sub}: a run", "meta": {"commit": commit}, "runs": {}, "summary": ["y"]}))
    block = rb.block(reports)
    assert "bench_interleaved" not in block and "def5678" in rb.index(reports)
    assert "0ld0001" not in block and "0ld0001" in rb.index(reports) and "fe5h001" in block
    assert "best speculative / plain at 1 row: 1.31×" in block and "`abc1234`" in block
    assert "(reports/bench_real/report.md)" in block and "reports/odd/report.json" in block
    assert "broken" not in block
    assert "abc1234" in rb.index(reports)


def test_the_reference_pages_are_generated_and_every_config_key_has_a_doc():
    ref = _load(REPO / "scripts" / "reference_docs.py", "docs_reference")
    assert not ref.stale(), f"stale: {ref.stale()} (run python scripts/reference_docs.py)"


def test_every_report_is_in_the_index():
    index = (REPO / "reports" / "README.md").read_text(encoding="utf-8")
    names = ("report.md", "tune_report.md", "README.md")
    pages = [p for p in (REPO / "reports").glob("*/**/*.md") if p.name in names]
    missing = [p.relative_to(REPO / "reports").as_posix() for p in pages
               if f"]({p.relative_to(REPO / 'reports').as_posix()})" not in index]
    assert not missing, f"reports/README.md does not link {missing}"


# ---------------------------------------------------------------------------- pages that follow the code
def test_the_code_map_lists_every_module():
    page = (REPO / "docs" / "code-map.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^- `([^`]+)`", page, re.M))
    wanted = set()
    for root in ("pipeline", "actors", "jobs", "bench", "scripts", "train", "examples", "deploy"):
        for p in (REPO / root).rglob("*"):
            if p.suffix in (".py", ".sh") and "__pycache__" not in p.parts:
                wanted.add(p.relative_to(REPO).as_posix())
    for p in (REPO / "tests").rglob("*.py"):
        if not p.name.startswith("test_") and "__pycache__" not in p.parts:
            wanted.add(p.relative_to(REPO).as_posix())
    for d in (REPO / "tests").iterdir():
        if d.is_dir() and d.name != "__pycache__":
            wanted.add(d.relative_to(REPO).as_posix() + "/")
    missing = sorted(w for w in wanted if w not in listed)
    assert not missing, f"docs/code-map.md does not list {missing}: add one line each"


def _imports_of(path: Path) -> list[str]:
    """Every absolute import of a Python file, at its top or inside a function: ``a.b`` and
    ``a.b.name`` for ``from a.b import name``."""
    import ast

    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


def test_the_code_map_lists_each_module_after_every_module_it_imports():
    """The page says it is in dependency order, and that nothing imports from a layer above its
    own: each listed module comes after every listed module it imports (a package's
    ``__init__.py``, the package's face, stands first and is left out of the rule)."""
    page = (REPO / "docs" / "code-map.md").read_text(encoding="utf-8")
    order = [p for p in re.findall(r"^- `([^`]+\.py)`", page, re.M) if not p.endswith("__init__.py")]
    module_of = {p[:-3].replace("/", "."): p for p in order}
    place = {p: i for i, p in enumerate(order)}
    late = []
    for path in order:
        for name in _imports_of(REPO / path):
            parts = name.split(".")
            target = next((module_of[".".join(parts[:n])] for n in range(len(parts), 0, -1)
                           if ".".join(parts[:n]) in module_of), None)
            if target is not None and target != path and place[target] > place[path]:
                late.append(f"{path} imports {target}")
    assert not late, f"docs/code-map.md lists these modules before what they import: {sorted(set(late))}"


def test_the_metrics_page_defines_every_statistic():
    from pipeline.engine.stats import COLUMNS, RowStats

    page = (REPO / "docs" / "metrics.md").read_text(encoding="utf-8")
    rates = [n for n, v in vars(RowStats).items() if isinstance(v, property)]
    missing = [n for n in [c.name for c in COLUMNS] + rates if f"`{n}" not in page]
    assert not missing, f"docs/metrics.md does not define {missing}"


def test_the_output_columns_are_documented():
    from pipeline.schema import OUTPUT_SCHEMA

    page = (REPO / "docs" / "running-jobs.md").read_text(encoding="utf-8")
    missing = [n for n in OUTPUT_SCHEMA.names if f"`{n}`" not in page]
    assert not missing, f"docs/running-jobs.md's Output section does not name {missing}"


def test_no_code_cites_the_metrics_file_outside_the_repository():
    bad = []
    for p in REPO.rglob("*"):
        if p.suffix not in (".py", ".yaml", ".yml", ".sh", ".md") or any(
                part in (".venv", ".git", "reports", "__pycache__", "node_modules") for part in p.parts):
            continue
        if p == Path(__file__).resolve() or p.is_dir():
            continue
        for n, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if re.search(r"(?<!docs/)METRICS\.md|shared/METRICS", line) and "was `../shared/METRICS.md`" not in line:
                bad.append(f"{p.relative_to(REPO)}:{n}")
    assert not bad, f"cite docs/metrics.md instead: {bad}"


def test_the_commented_config_shows_every_key():
    """configs/summarize.yaml, "a commented one", names every key of every section (set or commented out)."""
    from pipeline.config import JobConfig

    ref = _load(REPO / "scripts" / "reference_docs.py", "docs_reference")
    text = (REPO / "configs" / "summarize.yaml").read_text(encoding="utf-8")
    sections = dict(re.findall(r"^(\w+):[^\n]*\n((?:[ #][^\n]*\n|\n)*)", text, re.M))
    missing = []
    for s in ref.config_sections():
        body = sections.get(s["name"])
        for k in s["keys"]:
            if body is None or not re.search(rf"^\s+#?\s*{k['key']}:", body, re.M):
                missing.append(f"{s['name']}.{k['key']}")
    assert set(JobConfig.model_fields) <= set(sections), "a section is missing from configs/summarize.yaml"
    assert not missing, f"configs/summarize.yaml does not show {missing} (set it, or show it commented out)"


def test_the_input_and_output_packages_never_import_each_other():
    """What both sides need lies below them (pipeline/units.py, pipeline/layout.py, pipeline/storage.py),
    as the code map says: no module of pipeline/input/ imports pipeline.output, at the top or inside a
    function, and none of pipeline/output/ imports pipeline.input."""
    import ast

    crossings = []
    for side, other in (("input", "output"), ("output", "input")):
        for path in sorted((REPO / "pipeline" / side).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                if isinstance(node, ast.ImportFrom) and node.module == "pipeline":
                    names = [f"pipeline.{a.name}" for a in node.names]
                crossings += [f"{path.relative_to(REPO)}:{node.lineno} imports {n}" for n in names
                              if n == f"pipeline.{other}" or n.startswith(f"pipeline.{other}.")]
    assert crossings == []
