"""The lean Llama pass (pipeline/engine/cpu/lean.py) against the model's own forward, through the
runner: prefill, ragged decoding rows, a token tree; logits and the KV cache written, in
float64 (to rounding) and float32; which models and passes take it; weights changed in
place; forward hooks; the compiled layer of passes up to COMPILED_MAX_TOKENS tokens, chosen when the model is prepared."""

from __future__ import annotations

import pytest
import torch

from pipeline.engine.cpu import CpuOptions, lean, layer, payoff, prepare, smallm
from pipeline.engine.runner import ModelRunner

from tiny_models import build, prompt_of

#: the lean pass on or off, whatever the environment says (the tests compare both ways)
ON, OFF = CpuOptions(lean_pass=True), CpuOptions(lean_pass=False)


@pytest.fixture(autouse=True)
def _no_environment(monkeypatch):
    for name in ("SPECBATCH_CPU_KERNELS", "SPECBATCH_CPU_LEAN_PASS", "SPECBATCH_FUSED", "SPECBATCH_INDUCTOR",
                 "SPECBATCH_CPU_COMPILED_LAYER", "SPECBATCH_CPU_EXPECTED_TOKENS"):
        monkeypatch.delenv(name, raising=False)
    # these tests fake compile times and speeds: none of it goes to the node's ledger (cpu/payoff.py)
    monkeypatch.setattr(payoff.Ledger, "record", lambda *a, **k: None)


def _passes(runner: ModelRunner):
    """A prefill of two rows of different lengths, a ragged decoding pass (one row feeding 3
    tokens, the other 1), a pass with a token tree on one row; the logits of each."""
    a, b = prompt_of(9, seed=1)[0], prompt_of(5, seed=2)[0]
    out = [runner.forward([0], [a], [0], logits_to_keep=0).logits,
           runner.forward([1], [b], [0], logits_to_keep=0).logits,
           runner.forward([0, 1], [torch.tensor([3, 4, 5]), torch.tensor([6])], [9, 5], logits_to_keep=3).logits,
           runner.forward([1, 0], [torch.tensor([7, 8, 9, 10, 11]), torch.tensor([12])], [6, 12], logits_to_keep=5,
                          trees=[[-1, 0, -1, 2], None]).logits]
    return out


def _cache(runner: ModelRunner):
    return [(layer.keys.clone(), layer.values.clone()) for layer in runner.cache.layers]


def _run(model, use_fused: bool):
    plan = prepare(model, ON if use_fused else OFF)
    assert (plan.lean is not None) == use_fused, "a Llama with SDPA on the CPU takes the lean pass"
    runner = ModelRunner(model, 2)
    with torch.inference_mode():
        logits = _passes(runner)
    return logits, _cache(runner)


def _assert_same(got, got_cache, want, want_cache, tol: float) -> None:
    """Logits and KV caches of two runs of :func:`_passes` equal within ``tol``."""
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)
    for (gk, gv), (wk, wv) in zip(got_cache, want_cache):
        torch.testing.assert_close(gk, wk, rtol=tol, atol=tol)
        torch.testing.assert_close(gv, wv, rtol=tol, atol=tol)


@pytest.fixture
def counted(monkeypatch):
    calls = []
    real = lean.LeanPass.__call__
    monkeypatch.setattr(lean.LeanPass, "__call__", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-5), (torch.bfloat16, 1e-2)])  # bf16: a few ulps of logits ~0.3
def test_the_lean_pass_gives_the_models_logits_and_cache(counted, dtype, tol):
    model = build("llama", layers=3).to(dtype)
    want, want_cache = _run(model, False)
    assert not counted
    got, got_cache = _run(model, True)
    assert len(counted) == 4  # every pass took it
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)
    assert len(got_cache) == len(want_cache) == 3
    for (gk, gv), (wk, wv) in zip(got_cache, want_cache):
        torch.testing.assert_close(gk, wk, rtol=tol, atol=tol)
        torch.testing.assert_close(gv, wv, rtol=tol, atol=tol)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 1), (6, 2)])
def test_every_grouping_of_query_heads_gives_the_models_logits(heads, kv_heads, monkeypatch):
    """Verification passes fold each key/value head's query heads into the query length
    (lean.FOLD_MAX_QUERY); a prefill, one-token passes and a model without grouped heads do not."""
    model = build("llama", layers=2, hidden=48, num_attention_heads=heads, num_key_value_heads=kv_heads).double()
    want, want_cache = _run(model, False)
    widths = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(lean.F, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: widths.append((q.shape[1], q.shape[2], "enable_gqa" in kw)) or
                        real(q, k, v, **kw))
    got, got_cache = _run(model, True)
    _assert_same(got, got_cache, want, want_cache, 1e-12)
    group = heads // kv_heads
    # per layer: the two prefills (9 and 5 tokens), the ragged pass (3 tokens), the tree pass (5)
    want_calls = [(heads, 9, True), (heads, 5, True)] + ([(heads, 3, True), (heads, 5, True)] if group == 1 else
                                                         [(kv_heads, 3 * group, False), (kv_heads, 5 * group, False)])
    assert widths == [c for c in want_calls for _ in range(2)]


def test_short_masked_float32_passes_take_the_attention_kernel_and_give_the_models_logits(monkeypatch):
    """Heads of 32 (the kernel serves 32, 64, 128): the ragged and the tree pass (masked, 3 and 5
    tokens at 2 rows) run the small-M library's attention; the prefills keep SDPA's causal kernel."""
    if smallm.library_for(ON) is None:
        pytest.skip(f"no small-M kernels here: {smallm.why_unavailable()}")
    model = build("llama", layers=2, hidden=128, num_attention_heads=4, num_key_value_heads=2).float()
    want, want_cache = _run(model, False)
    calls = []
    real = smallm.Library.attention
    monkeypatch.setattr(smallm.Library, "attention", lambda self, q, *a, **k: calls.append(tuple(q.shape)) or real(self, q, *a, **k))
    got, got_cache = _run(model, True)
    _assert_same(got, got_cache, want, want_cache, 2e-5)
    assert calls == [(2, 4, 3, 32)] * 2 + [(2, 4, 5, 32)] * 2


def test_a_weight_changed_in_place_is_fused_again(counted):
    model = build("llama")
    _run(model, True)
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight.mul_(1.5)
        model.model.layers[0].mlp.up_proj.weight.add_(0.01)
    want, _ = _run(model, False)
    got, _ = _run(model, True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("change", ["eager", "attention_bias", "qwen2", "sliding"])
def test_models_it_does_not_implement_take_their_own_forward(change):
    if change == "eager":
        model = build("llama", attn_implementation="eager")
    elif change == "attention_bias":
        model = build("llama", attention_bias=True)
    elif change == "sliding":
        model = build("llama", layer_types=["sliding_attention", "full_attention"])
    else:
        model = build("qwen2")
    assert not lean.supports(model) and prepare(model, ON).lean is None


def test_forward_hooks_take_the_models_forward(counted):
    model = build("llama")
    prepare(model, ON)
    runner = ModelRunner(model, 1)
    p = prompt_of(6, seed=3)[0]
    with torch.inference_mode():
        runner.forward([0], [p], [0])
        assert len(counted) == 1
        seen = []
        handle = model.model.layers[0].register_forward_hook(lambda *a: seen.append(1))
        runner.forward([0], [torch.tensor([2])], [6])
        handle.remove()
        assert len(counted) == 1 and seen == [1]  # the hook ran: the model's forward
        runner.forward([0], [torch.tensor([3])], [7])
        assert len(counted) == 2


@pytest.mark.parametrize("select", [True, -1, [0, 2], [1, -1], 5])
def test_hidden_states_are_the_models(counted, select):
    """transformers' ``output_hidden_states``: all, by index, negative indices; its hooks stay
    installed after such a call and the lean pass goes on being taken."""
    model = build("llama", layers=3)
    out = {}
    for use in (False, True):
        prepare(model, ON if use else OFF)
        runner = ModelRunner(model, 2)
        with torch.inference_mode():
            runner.forward([0], [prompt_of(7, seed=4)[0]], [0])
            runner.forward([1], [prompt_of(4, seed=5)[0]], [0])
            out[use] = runner.forward([0, 1], [torch.tensor([5, 6]), torch.tensor([7])], [7, 4], logits_to_keep=2,
                                      output_hidden_states=select)
    assert len(counted) == 3
    want, got = out[False], out[True]
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-12, atol=1e-12)
    assert len(got.hidden_states) == len(want.hidden_states) == 4
    for g, w in zip(got.hidden_states, want.hidden_states):
        assert (g is None) == (w is None)
        if w is not None:
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    assert sum(h is not None for h in got.hidden_states) >= (0 if select == 5 else 1)


def test_the_parts_a_bench_wraps_run_once_per_layer_and_pass(monkeypatch):
    """bench/bench_llamacpp.py times a step by part by wrapping these module functions."""
    model = build("llama", layers=3)
    prepare(model, ON)
    runner = ModelRunner(model, 2)
    seen = {name: 0 for name in ("attention_in_of", "attend", "attention_out_of", "mlp_of", "output_layer")}
    for name in seen:
        real = getattr(lean, name)
        monkeypatch.setattr(lean, name, lambda *a, _n=name, _f=real, **k: seen.__setitem__(_n, seen[_n] + 1) or _f(*a, **k))
    with torch.inference_mode():
        _passes(runner)
    assert seen == {**dict.fromkeys(("attention_in_of", "attend", "attention_out_of", "mlp_of"), 4 * 3), "output_layer": 4}


def test_a_weight_replaced_is_fused_again(counted):
    model = build("llama")
    _run(model, True)
    proj = model.model.layers[0].self_attn.v_proj
    proj.weight = torch.nn.Parameter(proj.weight.detach() * -1.0)
    want, _ = _run(model, False)
    got, _ = _run(model, True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_a_pass_with_autograd_takes_the_models_forward(counted):
    """The fused weights are copies: gradients through them would never reach the model's."""
    model = build("llama")
    prepare(model, ON)
    with torch.inference_mode():
        ModelRunner(model, 1).forward([0], [prompt_of(5, seed=6)[0]], [0])
    assert len(counted) == 1
    runner = ModelRunner(model, 1)
    logits = runner.forward([0], [prompt_of(5, seed=6)[0]], [0]).logits
    assert len(counted) == 1 and logits.requires_grad
    logits.sum().backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None
    with torch.no_grad():  # made in inference mode, they serve outside it
        runner.forward([0], [torch.tensor([5])], [5])
    assert len(counted) == 2


def test_a_global_forward_hook_takes_the_models_forward(counted):
    from torch.nn.modules.module import register_module_forward_hook

    model = build("llama")
    prepare(model, ON)
    runner = ModelRunner(model, 1)
    seen = []
    handle = register_module_forward_hook(lambda *a: seen.append(1))
    try:
        with torch.inference_mode():
            runner.forward([0], [prompt_of(5, seed=7)[0]], [0])
    finally:
        handle.remove()
    assert not counted and seen


def _few_token_passes(model, compiled: bool, monkeypatch):
    """Prefills of two rows, then passes of 1-5 tokens in all (one-token passes on slot rows 0
    and 1, two rows of one token, a row of 3 tokens, a token tree of 5 nodes, two rows of 2 tokens) with hidden
    states asked for: the logits, hidden states and the cache after them.  With ``compiled``,
    the model is prepared with the compiled layer taken wherever it compiles (passes of up to
    lean.COMPILED_MAX_TOKENS tokens)."""
    monkeypatch.setattr(lean.LeanPass, "_offers_compiled_layer", lambda self: compiled)
    monkeypatch.setattr(lean.LeanPass, "_time", lambda self, tokens, graphs, costs: 0.0 if graphs else 1.0)
    plan = prepare(model, CpuOptions(lean_pass=True, compiled_layer=compiled))
    assert sorted(plan.lean.graphs) == (list(range(1, lean.COMPILED_MAX_TOKENS + 1)) if compiled else [])
    runner = ModelRunner(model, 2)
    out = []
    with torch.inference_mode():
        runner.forward([0], [prompt_of(7, seed=6)[0]], [0])
        runner.forward([1], [prompt_of(4, seed=7)[0]], [0])
        for slots, tokens, starts, trees in (([0], [[5]], [7], None), ([1], [[9]], [4], None),
                                             ([0, 1], [[2], [11]], [8, 5], None), ([1], [[3, 4, 6]], [6], None),
                                             ([0], [[7, 8, 9, 10, 12]], [9], [[-1, 0, -1, 2]]), ([0], [[1]], [10], None),
                                             ([0, 1], [[2, 3], [4, 5]], [11, 9], None)):
            r = runner.forward(slots, [torch.tensor(t) for t in tokens], starts, logits_to_keep=0,
                               output_hidden_states=True, trees=trees)
            out.append((r.logits, r.hidden_states))
    return out, _cache(runner)


def _rms_in_the_models_dtype(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_passes_of_few_tokens_through_the_compiled_layer_give_the_models_logits_and_cache(dtype, tol, monkeypatch):
    """float64 to 1e-12 with both ways' RMSNorm computed in float64: transformers' LlamaRMSNorm
    computes in float32 whatever the model's dtype, and inductor sums its squares in another
    order than eager (float32 rounding, ~1e-7, would hide any other difference)."""
    model = build("llama", layers=2, hidden=64, num_attention_heads=4, num_key_value_heads=2).to(dtype)
    if dtype == torch.float64:
        monkeypatch.setattr(layer, "rms", _rms_in_the_models_dtype)  # the graphs and the eager layer's norm alike
    calls = []
    real = lean.LeanPass.__call__

    def counted(self, *a, **k):
        calls.append(sorted(self.graphs))
        return real(self, *a, **k)

    monkeypatch.setattr(lean.LeanPass, "__call__", counted)
    want, want_cache = _few_token_passes(model, False, monkeypatch)
    got, got_cache = _few_token_passes(model, True, monkeypatch)
    assert calls[-1] == list(range(1, lean.COMPILED_MAX_TOKENS + 1))
    for (gl, gh), (wl, wh) in zip(got, want):
        torch.testing.assert_close(gl, wl, rtol=tol, atol=tol)
        for g, w in zip(gh, wh, strict=True):
            torch.testing.assert_close(g, w, rtol=tol, atol=tol)
    for (gk, gv), (wk, wv) in zip(got_cache, want_cache):
        torch.testing.assert_close(gk, wk, rtol=tol, atol=tol)
        torch.testing.assert_close(gv, wv, rtol=tol, atol=tol)


@pytest.mark.parametrize("compiled_seconds, chosen", [(0.5, True), (0.97, False), (2.0, False)])
def test_the_compiled_layer_is_taken_where_measured_faster_by_the_margin_at_load(compiled_seconds, chosen, monkeypatch):
    """Measured when the model is prepared, per token count up to lean.COMPILED_MAX_TOKENS, for
    float32 weights large enough; the compiled layer must beat the eager one by
    measure.MARGIN (0.95); off: neither compiled nor measured; nothing is measured in a pass."""
    compiled, timed = [], []
    monkeypatch.setattr(lean.compiled, "compile_layer", lambda **kw: compiled.append(kw["tokens"]) or ("graphs", kw["tokens"]))
    monkeypatch.setattr(lean.LeanPass, "_offers_compiled_layer", lambda self: True)
    monkeypatch.setattr(lean.LeanPass, "_time", lambda self, n, graphs, costs: timed.append((n, graphs is not None))
                        or (compiled_seconds if graphs else 1.0))
    model = build("llama", layers=2).float()
    plan = prepare(model, CpuOptions())
    counts = list(range(1, lean.COMPILED_MAX_TOKENS + 1))
    assert counts[:2] == [1, 2] and compiled == counts
    assert sorted(timed) == [(n, c) for n in counts for c in (False, True)]
    assert plan.lean.graphs == ({n: ("graphs", n) for n in counts} if chosen else {})
    assert plan.describe()["compiled_layer_tokens"] == (counts if chosen else [])
    compiled.clear(), timed.clear()
    plan = prepare(build("llama", layers=2).float(), CpuOptions(compiled_layer=False))
    assert not compiled and not timed and not plan.lean.graphs


def test_float64_and_small_weights_are_not_offered_the_compiled_layer(monkeypatch):
    monkeypatch.setattr(lean.LeanPass, "_time", lambda *a: pytest.fail("measured"))
    assert not prepare(build("llama", layers=2).double(), CpuOptions()).lean.graphs
    assert not prepare(build("llama", layers=2).float(), CpuOptions()).lean.graphs  # below INDUCTOR_MIN_ELEMENTS
