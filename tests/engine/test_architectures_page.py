"""The list of accepted architectures in docs/engine.md is the one the tests cover (coverage.py)."""

from __future__ import annotations

from pathlib import Path

from coverage import BATCH_ARCHS, DIFFERENTIAL_ARCHS, EARLY_EXIT_ARCHS, REFUSED, ROWS, SLIDING_ARCHS

PAGE = Path(__file__).resolve().parents[2] / "docs" / "engine.md"


def architecture_table() -> str:
    lines = ["| model class (tiny, random, float64) | attention / positions | lossless methods checked | batched | tests |",
             "| --- | --- | --- | :---: | --- |"]
    for _, cls, attention, methods, batched, files in ROWS:
        lines.append(f"| `{cls}` | {attention} | {', '.join(methods)} | {'yes' if batched else '–'} | {files} |")
    lines.append("")
    lines.append("Refused when the engine is built (the message names the layer type and the method): "
                 + ", ".join(sorted(REFUSED)) + "; `dynamic` RoPE scaling.")
    return "\n".join(lines)


def test_registry_is_consistent():
    labels = {r[0] for r in ROWS}
    assert set(DIFFERENTIAL_ARCHS + SLIDING_ARCHS + BATCH_ARCHS + EARLY_EXIT_ARCHS) <= labels
    batched = {r[0] for r in ROWS if r[4]}
    assert set(BATCH_ARCHS) <= batched
    for label, _, _, methods, _, _ in ROWS:
        if label in EARLY_EXIT_ARCHS + SLIDING_ARCHS:
            assert "early_exit" in methods, label


def test_the_engine_page_lists_the_tested_architectures():
    text = PAGE.read_text()
    start, end = "<!-- architectures:start -->\n", "\n<!-- architectures:end -->"
    block = text[text.index(start) + len(start): text.index(end)]
    assert block == architecture_table(), "update the block in docs/engine.md to:\n" + architecture_table()
