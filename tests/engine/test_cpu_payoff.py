"""Compiling only what pays (pipeline/engine/cpu/payoff.py): at load, an inductor part's graphs
are compiled when the expected tokens x the share they serve x the measured per-token saving
exceed the seconds compiling them costs; graphs in the node's cache cost what loading them
took; unknown tokens (a server, a bench) compile everything offered.  Every figure is injected:
nothing here is timed."""

from __future__ import annotations

import math

import pytest

from pipeline.engine.cpu import CpuOptions, lean, options, payoff, plan, prepare

from tiny_models import build


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith(options.ENV_PREFIX) or name in options.ENV_ALIASES:
            monkeypatch.delenv(name)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR", "/tmp"))  # restored after
    monkeypatch.setattr(payoff, "_COMPILED_IN_PROCESS", [False])  # a process that has compiled nothing yet


def test_the_rule_pays_does_not_pay_and_unknown_tokens_compile():
    # 2,560 tokens x 5 ms saved = 12.8 s against 4.5 s of compiling: pays
    d = payoff.decide("layer", graphs=3, expected_tokens=2560, token_saving_s=0.005, compile_s=4.5)
    assert d.pays and d.saving_s == pytest.approx(12.8) and "compiled (3 graphs, ~4.5 s" in d.line()
    # a quarter of those tokens served (4 rows in flight, passes of 1 token): 3.2 s < 4.5 s
    d = payoff.decide("layer", graphs=3, expected_tokens=2560, token_saving_s=0.005, compile_s=4.5,
                      share=payoff.served_share(1, 4))
    assert not d.pays and d.saving_s == pytest.approx(3.2) and d.line().startswith("layer: not compiled")
    assert not payoff.decide("x", graphs=1, expected_tokens=10**9, token_saving_s=-0.001, compile_s=0.0).pays
    d = payoff.decide("x", graphs=30, expected_tokens=None, token_saving_s=0.0, compile_s=45.0)
    assert d.pays and math.isinf(d.saving_s) and d.to_dict()["saving_s"] is None and "unknown" in d.line()
    assert [payoff.served_share(n, b) for n, b in ((1, None), (2, 2), (5, 4), (1, 4), (2, 8))] == [1, 1, 1, 0.25, 0.25]


def test_the_ledger_knows_what_the_node_compiled_and_what_it_cost(tmp_path):
    ledger = payoff.Ledger(str(tmp_path))
    key, other = payoff.graph_key("layer", 1, (64, 64)), payoff.graph_key("layer", 2, (64, 64))
    assert key != other and not ledger.cached(key)
    # a fresh cache folder, a process that has compiled nothing: both start-up costs on top
    assert ledger.cost(key, 3) == pytest.approx(3 * payoff.GRAPH_S + payoff.PROCESS_START_S + payoff.FRESH_CACHE_S)
    assert ledger.ratio(key, "compiled_layer") == payoff.PRIOR_RATIO["compiled_layer"]
    ledger.record(key, 3, 12.0, ratio=0.7)
    again = payoff.Ledger(str(tmp_path))  # another process of the node reads it
    assert again.cached(key) and again.ratio(key, "compiled_layer") == 0.7
    assert again.cost(key, 3) == pytest.approx(3 * payoff.CACHED_GRAPH_S)  # in the cache: loaded, not compiled
    assert again.cost(other, 6) == pytest.approx(6 * payoff.GRAPH_S)  # inductor running, the folder used
    assert payoff.Ledger(str(tmp_path)).entries[key] == {"graphs": 3, "seconds": 12.0, "ratio": 0.7}
    (tmp_path / payoff.LEDGER_FILE).write_text("not json")
    assert payoff.Ledger(str(tmp_path)).entries == {}
    nowhere = payoff.Ledger(None)
    nowhere.record(key, 3, 1.0)
    assert not nowhere.cached(key)


def _offer_the_compiled_layer(monkeypatch, eager_s: float = 0.01, compiled_s: float = 0.006):
    """The compiled layer offered to a tiny float32 Llama, its eager and compiled times injected
    (seconds for the whole pass of n tokens), compiling recorded instead of done."""
    made = []

    def compile_layer(**kw):
        made.append(kw["tokens"])
        return ("graphs", kw["tokens"])

    monkeypatch.setattr(lean.compiled, "compile_layer", compile_layer)
    monkeypatch.setattr(lean.LeanPass, "_offers_compiled_layer", lambda self: True)
    monkeypatch.setattr(lean.LeanPass, "_time", lambda self, n, graphs, costs: compiled_s if graphs else eager_s)
    return made


@pytest.mark.parametrize("expected, rows, compiled", [
    (None, 4, [1, 2]),    # unknown (a server): everything offered
    (100_000, 4, [1, 2]),  # a long job: 100k x 1/4 x 2 ms = 50 s against 17.9 s (a fresh node) for one token
    (10_000, 1, [1, 2]),   # 20 s against 17.9 s; then 10 s against 3.9 s for two tokens (inductor running)
    (2_560, 1, []),        # the quick start's tokens: 5.1 s against 17.9 s
    (2_560, 4, []),        # ... at 4 rows in flight, passes of 1-2 tokens are a batch's drain: 1.3 s
    (0, 1, []),
])
def test_the_compiled_layer_is_compiled_only_where_the_expected_tokens_repay_it(
        expected, rows, compiled, monkeypatch, tmp_path):
    made = _offer_the_compiled_layer(monkeypatch)  # 10 ms a one-token pass eager, prior ratio 0.8: 2 ms a token
    p = prepare(build("llama", layers=2).float(), CpuOptions(compile_cache=str(tmp_path), expected_tokens=expected),
                rows_in_flight=rows)
    assert made == compiled and sorted(p.lean.graphs) == compiled
    assert [d.pays for d in p.compiling] == [n in compiled for n in (1, 2)]
    assert [d["part"] for d in p.describe()["compiling"]] == ["compiled layer, 1 token", "compiled layer, 2 tokens"]
    line = p.summary()
    assert (f"compiled {3 * len(compiled)} graphs" in line and "expected saving" in line) if compiled else "not compiled: " in line


def test_graphs_in_the_nodes_cache_are_loaded_for_a_short_job(monkeypatch, tmp_path):
    """A first process compiles (a long job); a later short job finds them in the ledger, costing
    the load it recorded, and takes them; with the measured ratio, not the prior."""
    made = _offer_the_compiled_layer(monkeypatch)
    prepare(build("llama", layers=2).float(), CpuOptions(compile_cache=str(tmp_path)), rows_in_flight=4)
    assert made == [1, 2]
    ledger = payoff.Ledger(str(tmp_path))
    assert len(ledger.entries) == 2 and {e["ratio"] for e in ledger.entries.values()} == {0.6}
    made.clear()
    p = prepare(build("llama", layers=2).float(), CpuOptions(compile_cache=str(tmp_path), expected_tokens=2_560),
                rows_in_flight=4)
    assert made == [1, 2] and all(d.cached and d.pays for d in p.compiling)
    assert "from the cache" in p.summary()


def test_the_row_dot_kernels_are_offered_only_where_they_pay(monkeypatch, tmp_path):
    """The row-dot kernels' saving is estimated from the eager linear layers' time for one token
    (injected), their cost from the graphs they would compile; not paying, the linear layers are
    prepared with ``rowdot`` off."""
    monkeypatch.setattr(plan, "INDUCTOR_MIN_ELEMENTS", 1)  # the tiny model's weights count as large
    monkeypatch.setattr(plan, "best_of", lambda run, costs=None, clock=None: 0.02)  # 20 ms a token eager
    seen = []
    real = plan.prepare_linears
    monkeypatch.setattr(plan, "prepare_linears", lambda mods, opts, **kw: seen.append(opts.rowdot) or real(mods, opts, **kw))
    for expected, pays in ((1_000, False), (1_000_000, True), (None, True)):
        seen.clear()
        p = prepare(build("llama", layers=2).float(),
                    CpuOptions(compile_cache=str(tmp_path), expected_tokens=expected, lean_pass=False), rows_in_flight=4)
        rowdot = p.compiling[0]
        assert rowdot.part == "row-dot kernels" and rowdot.pays == pays and seen == [pays]
        assert p.options.rowdot  # the plan keeps the options it was given
    assert rowdot.graphs and rowdot.graphs % 5 == 0  # each weight shape x 5 row counts


def test_expected_tokens_is_an_option_with_its_environment_variable(monkeypatch):
    assert CpuOptions(expected_tokens=5).validate().expected_tokens == 5
    for bad in (-1, 2.5, True, "many"):
        with pytest.raises(ValueError, match="expected_tokens"):
            CpuOptions(expected_tokens=bad).validate()
    monkeypatch.setenv("SPECBATCH_CPU_EXPECTED_TOKENS", "12000")
    assert options.with_environment(CpuOptions()).expected_tokens == 12000
    monkeypatch.setenv("SPECBATCH_CPU_EXPECTED_TOKENS", "none")
    assert options.with_environment(CpuOptions(expected_tokens=3)).expected_tokens is None
    with pytest.raises(ValueError, match="SPECBATCH_CPU_EXPECTED_TOKENS"):
        options.check_env_value("SPECBATCH_CPU_EXPECTED_TOKENS", "lots")
    assert "expected_tokens" not in options.PARTS and "compiled_layer" in options.PARTS


def test_the_job_sets_each_actors_expected_tokens_from_its_rows():
    from pipeline.config import load_config
    from pipeline.engine import GenerationSettings
    from pipeline.run import with_expected_tokens

    cfg = load_config(None, ["compute.num_actors=2", "audit.fraction=0.5"])
    got = with_expected_tokens(cfg, 21, GenerationSettings(max_new_tokens=64))
    assert got.cpu.cpu_options().expected_tokens == 11 * 64 * 1.5 and cfg.cpu.expected_tokens is None
    assert got.model_dump()["cpu"]["expected_tokens"] == 1056  # what the actors are given
    mine = load_config(None, ["cpu.expected_tokens=5"])
    assert with_expected_tokens(mine, 21, GenerationSettings(max_new_tokens=64)) is mine  # the user's own figure
