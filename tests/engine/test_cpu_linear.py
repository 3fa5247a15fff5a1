"""The CPU linear layers (pipeline/engine/cpu/linear.py): each weight shape's kernel per row count
measured when the model is prepared, every kernel giving F.linear's values, copies following a
weight changed in place, bfloat16 widened where oneDNN cannot pack it, the row-dot kernel offered
only where it may pay and left out where it cannot be compiled."""

import copy
import pickle

import pytest
import torch

from pipeline.engine.cpu import CpuOptions, linear, prepare, smallm
from pipeline.engine.cpu.linear import (KERNELS, ROWDOT_MAX_ROWS, SMALL_MAX_ROWS, PackedLinear, ShapeKernels,
                                        prepare_linears)
from pipeline.engine.cpu.options import compile_cache_dir

#: the small-M kernel where this machine builds it (``None``: the tests of it skip)
SMALLM = smallm.library(compile_cache_dir(CpuOptions()))

pytestmark = pytest.mark.skipif(not linear.onednn_available(), reason="this torch has no oneDNN")


def _model(seed: int, out_features: int):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, out_features), torch.nn.Linear(out_features, 24, bias=False),
                               torch.nn.Linear(24, out_features)).eval()


def test_each_weight_shape_is_measured_once_and_its_layers_share_the_choice():
    model = _model(0, 37)
    plan = prepare(model, CpuOptions())
    assert all(type(m) is PackedLinear for m in model)
    assert model[0].kernels is model[2].kernels and model[1].kernels is not model[0].kernels
    assert {tuple(k.shape): k.layers for k in plan.kernels.values()} == {(37, 24): 2, (24, 37): 1}
    for k in plan.kernels.values():
        assert len(k.choice) == SMALL_MAX_ROWS and set(k.choice) <= set(KERNELS) and k.default == "onednn"
        for m in model:  # a transposed copy is kept exactly where its shape chose that kernel
            if m.kernels is k:
                assert ("transposed" in k._copies.get(m, {})) == ("transposed" in k.choice)
    assert prepare(model, CpuOptions()) is plan  # prepared once
    assert plan.measure_s > 0
    assert plan.describe()["linear_kernels"][0]["rows"].keys() == {str(r) for r in range(1, SMALL_MAX_ROWS + 1)}


def _calls(monkeypatch):
    """Which kernel each call of a PackedLinear took: a list the patched kernels append to."""
    calls = []
    real = {"mkl": linear.F.linear, "mm": torch.mm, "addmm": torch.addmm}
    monkeypatch.setattr(linear.F, "linear", lambda *a, **k: calls.append("mkl") or real["mkl"](*a, **k))
    monkeypatch.setattr(linear.torch, "mm", lambda *a, **k: calls.append("transposed") or real["mm"](*a, **k))
    monkeypatch.setattr(linear.torch, "addmm", lambda *a, **k: calls.append("transposed") or real["addmm"](*a, **k))
    onednn = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(linear.torch.ops.mkldnn, "_linear_pointwise",
                        lambda *a, **k: calls.append("onednn") or onednn(*a, **k), raising=False)
    small = smallm.Library.linear
    monkeypatch.setattr(smallm.Library, "linear", lambda *a, **k: calls.append("smallm") or small(*a, **k))
    return calls, real["mkl"]


def _set_choice(layer, choice, monkeypatch):
    """Give ``layer``'s shape ``choice``, its row-dot kernels compiled (as a measurement that chose them would)."""
    k = layer.kernels
    monkeypatch.setattr(k, "choice", tuple(choice))
    if "smallm" in choice:
        monkeypatch.setattr(k, "lib", SMALLM)
    for rows, kernel in enumerate(choice, 1):
        if kernel == "rowdot" and rows not in k.rowdot:
            w = layer.weight
            k.rowdot[rows] = linear.compile_graph(linear.products, (torch.zeros(tuple(w.shape)), torch.zeros(rows, w.shape[1])),
                                                  "test")
    calls = []
    for rows in list(k.rowdot):
        dot = k.rowdot[rows]
        k.rowdot[rows] = lambda *a, _dot=dot: calls.append("rowdot") or _dot(*a)
    return calls


@pytest.mark.parametrize("chosen", [("onednn",) * 8, ("mkl", "mkl", "onednn", "mkl", "onednn", "mkl", "mkl", "onednn"),
                                    ("transposed", "onednn", "mkl", "transposed", "mkl", "smallm", "onednn", "mkl"),
                                    ("transposed",) * 8, ("smallm",) * 8,
                                    ("rowdot", "rowdot", "transposed", "rowdot", "rowdot", "smallm", "smallm", "mkl")])
def test_every_kernel_gives_f_linear_values_and_small_inputs_go_where_the_choice_says(monkeypatch, chosen):
    assert len(chosen) == SMALL_MAX_ROWS
    if "smallm" in chosen and SMALLM is None:
        pytest.skip(f"no small-M kernel here: {smallm.why_unavailable()}")
    model = _model(1, 41)
    reference = [(m.weight.detach().clone(), None if m.bias is None else m.bias.detach().clone()) for m in model]
    prepare(model, CpuOptions())
    rowdot_calls = [_set_choice(m, chosen, monkeypatch) for m in model]
    calls, real_linear = _calls(monkeypatch)
    with torch.inference_mode():
        for i in (0, 1):  # with a bias and without
            for shape in [(1, 24), (2, 24), (1, 3, 24), (4, 24), (1, 5, 24), (6, 24), (1, 7, 24), (8, 24), (2, 5, 24)]:
                x = torch.randn(*shape[:-1], model[i].in_features)
                calls.clear()
                rowdot_calls[i].clear()
                got = model[i](x)
                w, b = reference[i]
                torch.testing.assert_close(got, real_linear(x, w, b), rtol=1e-5, atol=1e-5)
                rows = x.numel() // model[i].in_features
                want = chosen[rows - 1] if rows <= SMALL_MAX_ROWS else "onednn"
                assert calls + rowdot_calls[i] == [want], (shape, calls)


def test_the_copies_follow_a_weight_changed_in_place_and_a_deep_copy_makes_its_own(monkeypatch):
    model = _model(3, 45)
    prepare(model, CpuOptions())
    layer = model[0]
    x = torch.randn(1, 24)
    for choice in (("transposed",) * SMALL_MAX_ROWS, ("onednn",) * SMALL_MAX_ROWS, ("smallm",) * SMALL_MAX_ROWS):
        if choice[0] == "smallm":
            if SMALLM is None:
                continue
            monkeypatch.setattr(layer.kernels, "lib", SMALLM)
        monkeypatch.setattr(layer.kernels, "choice", choice)
        with torch.no_grad():
            layer(x)
            layer.weight.mul_(2.0)  # in place: same storage, a new version
            got = layer(x)
        torch.testing.assert_close(got, torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    twin = copy.deepcopy(layer)
    assert twin.kernels is layer.kernels  # the choice is shared, the copies are not
    with torch.no_grad():
        twin.weight.mul_(-1.0)
        torch.testing.assert_close(twin(x), torch.nn.functional.linear(x, twin.weight, twin.bias), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    restored = pickle.loads(pickle.dumps(layer.kernels))
    assert isinstance(restored, ShapeKernels) and restored.choice == layer.kernels.choice and not restored.rowdot


def test_bfloat16_where_onednn_cannot_pack_it_widens_long_inputs_and_keeps_short_ones_on_f_linear(monkeypatch):
    monkeypatch.setattr(linear, "PACKED_DTYPES", (torch.float32,))  # an AVX2-only CPU, whatever this one is
    model = _model(2, 43).to(torch.bfloat16)
    plan = prepare(model, CpuOptions())
    assert all(type(m) is PackedLinear for m in model) and plan.measure_s == 0  # nothing packed, nothing measured
    assert {k.default for k in plan.kernels.values()} == {"widen"}
    calls = []
    real_linear = linear.F.linear
    monkeypatch.setattr(linear.F, "linear", lambda *a, **k: calls.append(a[0].dtype) or real_linear(*a, **k))
    w, b = model[0].weight.detach(), model[0].bias.detach()
    with torch.inference_mode():
        for rows in (1, linear.BF16_UPCAST_MIN_ROWS - 1, linear.BF16_UPCAST_MIN_ROWS, 100):
            x = torch.randn(rows, 24, dtype=torch.bfloat16)
            calls.clear()
            got = model[0](x)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, 43)
            widened = rows >= linear.BF16_UPCAST_MIN_ROWS
            assert calls == [torch.float32 if widened else torch.bfloat16]
            exact = real_linear(x.double(), w.double(), b.double())  # the exact sum, rounded once
            assert (got.double() - exact).abs().max() <= 2 ** -7 * exact.abs().max()  # within bfloat16's rounding


def test_the_row_dot_kernel_is_offered_only_to_large_float32_weights_and_computes_x_wt(monkeypatch):
    big = torch.nn.Linear(512, linear.INDUCTOR_MIN_ELEMENTS // 512, bias=False).eval()  # just large enough
    small = torch.nn.Linear(24, 47, bias=False).eval()
    compiled = []
    real_compile = linear.compile_graph
    monkeypatch.setattr(linear, "compile_graph", lambda fn, ex, *a, **k: compiled.append(tuple(ex[0].shape)) or
                        real_compile(fn, ex, *a, **k))
    prepare_linears([big, small], CpuOptions(smallm=False))
    assert compiled == [tuple(big.weight.shape)] * ROWDOT_MAX_ROWS
    torch.manual_seed(5)
    for rows in range(1, ROWDOT_MAX_ROWS + 1):
        dot = real_compile(linear.products, (torch.zeros(tuple(big.weight.shape)), torch.zeros(rows, 512)), "test")
        assert dot is not None  # this machine compiles C++ (torch.compile needs it too)
        x = torch.randn(rows, 512)
        with torch.inference_mode():
            torch.testing.assert_close(dot(big.weight.detach(), x), x @ big.weight.detach().T, rtol=1e-5, atol=1e-5)
        with torch.no_grad():  # and outside inference mode, with another weight of that shape
            w = torch.randn_like(big.weight)
            torch.testing.assert_close(dot(w, x), x @ w.T, rtol=1e-5, atol=1e-4)  # sums of 512 products ~1
    compiled.clear()
    other = torch.nn.Linear(512, linear.INDUCTOR_MIN_ELEMENTS // 512, bias=False).eval()
    assert "rowdot" not in prepare_linears([other], CpuOptions(rowdot=False))[linear.shape_key(other.weight)].choice
    assert not compiled
    if SMALLM is not None:  # where the small-M kernel is offered, the row-dot kernel is not (nothing compiled)
        prepare_linears([torch.nn.Linear(512, linear.INDUCTOR_MIN_ELEMENTS // 512, bias=False).eval()], CpuOptions())
        assert not compiled


def test_a_shape_whose_row_dot_kernel_cannot_be_compiled_keeps_the_other_kernels(monkeypatch):
    import torch._inductor.compile_fx as compile_fx

    layer = torch.nn.Linear(512, linear.INDUCTOR_MIN_ELEMENTS // 512).eval()
    monkeypatch.setattr(compile_fx, "compile_fx", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no compiler")))
    k = prepare_linears([layer], CpuOptions(smallm=False))[linear.shape_key(layer.weight)]
    assert "rowdot" not in k.choice and not k.rowdot
    monkeypatch.setattr(k, "choice", ("rowdot",) + ("onednn",) * (SMALL_MAX_ROWS - 1))  # chosen, but not there
    calls, real_linear = _calls(monkeypatch)
    x = torch.randn(1, 512)
    with torch.inference_mode():
        got = layer(x)
    assert calls == ["mkl"]
    torch.testing.assert_close(got, real_linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options, default, offered", [
    (CpuOptions(), "onednn", {"onednn", "mkl", "transposed", "smallm"}),
    (CpuOptions(onednn=False), "mkl", {"mkl", "transposed", "smallm"}),
    (CpuOptions(transposed=False), "onednn", {"onednn", "mkl", "smallm"}),
    (CpuOptions(smallm=False), "onednn", {"onednn", "mkl", "transposed"}),
])
def test_the_options_decide_which_kernels_are_timed(monkeypatch, options, default, offered):
    if SMALLM is None:
        offered = offered - {"smallm"}
    timed = set()
    real = linear._run
    monkeypatch.setattr(linear, "_run", lambda kernel, *a: timed.add(kernel) or real(kernel, *a))
    layer = torch.nn.Linear(24, 51).eval()
    k = prepare_linears([layer], options)[linear.shape_key(layer.weight)]
    assert k.default == default and timed == offered and set(k.choice) <= offered


def test_with_every_linear_part_off_the_layers_stay_nn_linear():
    model = _model(4, 53)
    plan = prepare(model, CpuOptions(onednn=False, transposed=False, rowdot=False, smallm=False))

    assert all(type(m) is torch.nn.Linear for m in model) and not plan.kernels
