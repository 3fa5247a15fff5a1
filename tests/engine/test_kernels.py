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
