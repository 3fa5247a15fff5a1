"""The CPU kernels' linear layers: oneDNN's packed kernel or MKL's F.linear by rows of input,
the split measured once per weight shape (pipeline/engine/kernels.py)."""

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
        kernels._MKL_ROWS.pop(k, None)
    assert kernels.pack_linears(model) == 3
    assert all(type(m) is kernels.PackedLinear for m in model)
    for k in keys:
        assert 0 <= kernels._MKL_ROWS[k] <= kernels.MKL_MAX_ROWS
    assert all(m in kernels._PACKED for m in model)  # measuring packed them
    kernels._MKL_ROWS[kernels._shape_key(model[0].weight)] = 99  # a remembered answer is not measured again
    assert kernels.small_rows_to_mkl([model[0], model[2]]) == 99
    assert kernels.pack_linears(model) == 0  # already packed


@pytest.mark.parametrize("rows_to_mkl", [0, 1, 3])
def test_either_kernel_gives_f_linear_values_and_small_inputs_go_where_the_measurement_said(monkeypatch, rows_to_mkl):
    model = _model(1, 41)
    reference = [(m.weight.detach().clone(), None if m.bias is None else m.bias.detach().clone()) for m in model]
    kernels.pack_linears(model)
    calls = []
    real_linear = kernels.F.linear
    monkeypatch.setattr(kernels.F, "linear", lambda *a, **k: calls.append(a[0].shape) or real_linear(*a, **k))
    for m in model:
        monkeypatch.setitem(kernels._MKL_ROWS, kernels._shape_key(m.weight), rows_to_mkl)
    with torch.inference_mode():
        for shape in [(1, 24), (2, 24), (1, 3, 24), (4, 24), (2, 5, 24)]:
            x = torch.randn(*shape)
            calls.clear()
            got = model[0](x)
            w, b = reference[0]
            torch.testing.assert_close(got, real_linear(x, w, b), rtol=1e-5, atol=1e-5)
            rows = x.numel() // 24
            assert (len(calls) == 1) == (rows <= rows_to_mkl), (shape, rows_to_mkl, calls)


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
