"""The CPU kernels' linear layers: oneDNN's packed kernel, MKL's F.linear or MKL's product with a
transposed copy of the weight by rows of input, the choice measured once per weight shape
(pipeline/engine/kernels.py)."""

import pytest
import torch

from pipeline.engine import kernels

pytestmark = pytest.mark.skipif(not (kernels.enabled() and kernels._onednn_available()),
                                reason="the CPU kernels are off or oneDNN is missing")


def _model(seed: int, out_features: int):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, out_features), torch.nn.Linear(out_features, 24, bias=False),
                               torch.nn.Linear(24, out_features)).eval()


def test_pack_linears_measures_each_weight_shape_once_and_packs_every_layer():
    model = _model(0, 37)  # a shape no other test uses: measured here
    keys = {kernels._shape_key(m.weight) for m in model}
    for k in keys:
        kernels._SMALL_ROWS.pop(k, None)
    assert kernels.pack_linears(model) == 3
    assert all(type(m) is kernels.PackedLinear for m in model)
    for k in keys:
        chosen = kernels._SMALL_ROWS[k]
        assert len(chosen) == kernels.SMALL_MAX_ROWS and set(chosen) <= set(kernels.KERNELS)
    assert all(m in kernels._PACKED for m in model)  # measuring packed them
    for m in model:  # a transposed copy is kept exactly where its shape chose that kernel
        assert (m in kernels._TRANSPOSED) == ("transposed" in kernels._SMALL_ROWS[kernels._shape_key(m.weight)])
    kernels._SMALL_ROWS[kernels._shape_key(model[0].weight)] = ("mkl",) * kernels.SMALL_MAX_ROWS  # a remembered answer is not measured again
    assert kernels.small_row_kernels([model[0], model[2]]) == ("mkl",) * kernels.SMALL_MAX_ROWS
    assert kernels.pack_linears(model) == 0  # already packed


def _calls(monkeypatch):
    """Which kernel each call of a PackedLinear took: a list the patched kernels append to."""
    calls = []
    real = {"mkl": kernels.F.linear, "transposed_mm": torch.mm, "transposed_addmm": torch.addmm}
    monkeypatch.setattr(kernels.F, "linear", lambda *a, **k: calls.append("mkl") or real["mkl"](*a, **k))
    monkeypatch.setattr(kernels.torch, "mm", lambda *a, **k: calls.append("transposed") or real["transposed_mm"](*a, **k))
    monkeypatch.setattr(kernels.torch, "addmm",
                        lambda *a, **k: calls.append("transposed") or real["transposed_addmm"](*a, **k))
    real_rowdot = kernels.rowdot

    def rowdot(w, rows=1):
        dot = real_rowdot(w, rows)
        return None if dot is None else (lambda *a: calls.append("inductor") or dot(*a))
    monkeypatch.setattr(kernels, "rowdot", rowdot)
    onednn = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(kernels.torch.ops.mkldnn, "_linear_pointwise",
                        lambda *a, **k: calls.append("onednn") or onednn(*a, **k), raising=False)
    return calls, real["mkl"]


@pytest.mark.parametrize("chosen", [("onednn",) * 5, ("mkl", "mkl", "onednn", "mkl", "onednn"),
                                    ("transposed", "onednn", "mkl", "transposed", "mkl"), ("transposed",) * 5,
                                    ("inductor", "inductor", "transposed", "inductor", "inductor")])
def test_every_kernel_gives_f_linear_values_and_small_inputs_go_where_the_measurement_said(monkeypatch, chosen):
    model = _model(1, 41)
    reference = [(m.weight.detach().clone(), None if m.bias is None else m.bias.detach().clone()) for m in model]
    kernels.pack_linears(model)
    for m in model:
        monkeypatch.setitem(kernels._SMALL_ROWS, kernels._shape_key(m.weight), chosen)
        for rows in range(1, kernels.SMALL_MAX_ROWS + 1):
            if chosen[rows - 1] == "inductor":
                kernels.rowdot(m.weight, rows)  # compiled before torch's kernels are patched (inductor reads them)
    calls, real_linear = _calls(monkeypatch)
    with torch.inference_mode():
        for i in (0, 1):  # with a bias and without
            for shape in [(1, 24), (2, 24), (1, 3, 24), (4, 24), (1, 5, 24), (6, 24), (2, 5, 24)]:
                x = torch.randn(*shape[:-1], model[i].in_features)
                calls.clear()
                got = model[i](x)
                w, b = reference[i]
                torch.testing.assert_close(got, real_linear(x, w, b), rtol=1e-5, atol=1e-5)
                rows = x.numel() // model[i].in_features
                assert calls == [chosen[rows - 1] if rows <= kernels.SMALL_MAX_ROWS else "onednn"], (shape, calls)


def test_the_transposed_copy_follows_a_weight_changed_in_place(monkeypatch):
    model = _model(3, 45)
    kernels.pack_linears(model)
    layer = model[0]
    monkeypatch.setitem(kernels._SMALL_ROWS, kernels._shape_key(layer.weight), ("transposed",) * kernels.SMALL_MAX_ROWS)
    x = torch.randn(1, 24)
    with torch.no_grad():
        layer(x)
        layer.weight.mul_(2.0)  # in place: same storage, a new version
        got = layer(x)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_bfloat16_where_onednn_cannot_pack_it_widens_long_inputs_and_keeps_short_ones_on_f_linear(monkeypatch):
    monkeypatch.setattr(kernels, "PACKED_DTYPES", (torch.float32,))  # an AVX2-only CPU, whatever this one is
    model = _model(2, 43).to(torch.bfloat16)
    assert kernels.pack_linears(model) == 3
    assert not any(m in kernels._PACKED for m in model)  # nothing packed, nothing measured
    calls = []
    real_linear = kernels.F.linear
    monkeypatch.setattr(kernels.F, "linear", lambda *a, **k: calls.append(a[0].dtype) or real_linear(*a, **k))
    w, b = model[0].weight.detach(), model[0].bias.detach()
    with torch.inference_mode():
        for rows in (1, kernels.BF16_UPCAST_MIN_ROWS - 1, kernels.BF16_UPCAST_MIN_ROWS, 100):
            x = torch.randn(rows, 24, dtype=torch.bfloat16)
            calls.clear()
            got = model[0](x)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, 43)
            widened = rows >= kernels.BF16_UPCAST_MIN_ROWS
            assert calls == [torch.float32 if widened else torch.bfloat16]
            exact = real_linear(x.double(), w.double(), b.double())  # the exact sum, rounded once
            assert (got.double() - exact).abs().max() <= 2 ** -7 * exact.abs().max()  # within bfloat16's rounding


def test_the_inductor_kernel_computes_small_inputs_and_is_offered_only_for_large_float32_weights(monkeypatch):
    big = torch.nn.Linear(512, kernels.INDUCTOR_MIN_ELEMENTS // 512, bias=False).eval()  # just large enough
    small = torch.nn.Linear(24, 47, bias=False).eval()  # a shape no other test uses
    offered = []
    real_rowdot = kernels.rowdot
    monkeypatch.setattr(kernels, "rowdot", lambda w, rows=1: offered.append((tuple(w.shape), rows)) or real_rowdot(w, rows))
    for m in (big, small):
        kernels._SMALL_ROWS.pop(kernels._shape_key(m.weight), None)
        kernels.pack_linears(m)
    assert sorted(offered) == [(tuple(big.weight.shape), rows) for rows in range(1, kernels.SMALL_MAX_ROWS + 1)]
    torch.manual_seed(5)
    for rows in range(1, kernels.SMALL_MAX_ROWS + 1):
        dot = real_rowdot(big.weight, rows)
        assert dot is not None  # this machine compiles C++ (torch.compile needs it too)
        x = torch.randn(512) if rows == 1 else torch.randn(rows, 512)
        with torch.inference_mode():
            torch.testing.assert_close(dot(big.weight.detach(), x), x @ big.weight.detach().T, rtol=1e-5, atol=1e-5)
        with torch.no_grad():  # and outside inference mode, with another weight of that shape
            w = torch.randn_like(big.weight)
            torch.testing.assert_close(dot(w, x), x @ w.T, rtol=1e-5, atol=1e-4)  # sums of 512 products ~1
    kernels._SMALL_ROWS.pop(kernels._shape_key(big.weight), None)
    monkeypatch.setenv("SPECBATCH_INDUCTOR", "0")
    offered.clear()
    assert "inductor" not in kernels.small_row_kernels([big])
    assert not offered


def test_a_shape_whose_inductor_kernel_cannot_be_compiled_falls_back_to_onednn(monkeypatch):
    import torch._inductor.compile_fx as compile_fx

    layer = torch.nn.Linear(24, 49).eval()
    kernels.pack_linears(layer)
    key = kernels._shape_key(layer.weight)
    monkeypatch.setitem(kernels._SMALL_ROWS, key, ("inductor",) + ("onednn",) * (kernels.SMALL_MAX_ROWS - 1))
    monkeypatch.delitem(kernels._ROWDOT, key + (1,), raising=False)
    monkeypatch.setattr(compile_fx, "compile_fx", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no compiler")))
    assert kernels.rowdot(layer.weight) is None and kernels._ROWDOT[key + (1,)] is None
    calls, real_linear = _calls(monkeypatch)
    x = torch.randn(1, 24)
    with torch.inference_mode():
        got = layer(x)
    assert calls == ["onednn"]
    torch.testing.assert_close(got, real_linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
