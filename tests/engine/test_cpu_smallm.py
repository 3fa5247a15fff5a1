"""The small-M linear kernel (pipeline/engine/cpu/smallm.py, csrc/smallm.c): x @ W^T (+ bias) within
float32 rounding of the float64 product for odd shapes and 1-33 rows, bitwise the same for a row
whatever the rows beside it (and on the AVX2 and AVX-512 paths alike), built once into the cache
folder, and simply not offered where it cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch

from pipeline.engine.cpu import CpuOptions, linear, smallm
from pipeline.engine.cpu.options import compile_cache_dir

LIB = smallm.library(compile_cache_dir(CpuOptions()))
needs_kernel = pytest.mark.skipif(LIB is None, reason=f"no small-M kernel here: {smallm.why_unavailable()}")


def _paths():
    """The SIMD paths this CPU runs: AVX2 always, AVX-512 where it has it."""
    return [False, True] if LIB is not None and LIB.wide else [False]


@needs_kernel
@pytest.mark.parametrize("out_features, in_features", [(37, 24), (16, 16), (32, 7), (47, 513), (96, 100), (5, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_kernel_computes_x_wt_within_float32_rounding_for_odd_shapes(monkeypatch, out_features, in_features,
                                                                         with_bias):
    g = torch.Generator().manual_seed(out_features * 1000 + in_features)
    w = torch.randn(out_features, in_features, generator=g)
    bias = torch.randn(out_features, generator=g) if with_bias else None
    packed = LIB.pack(w)
    assert packed.numel() == -(-out_features // 32) * 32 * in_features
    for wide in _paths():
        monkeypatch.setattr(LIB, "wide", wide)
        for rows in range(1, 34):
            x = torch.randn(rows, in_features, generator=g)
            y = LIB.linear(x, packed, out_features, bias)
            exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
            bound = 2 * in_features * 2 ** -24 * ((x.double().abs() @ w.double().abs().T) + 1)  # float32 summation
            assert y.shape == (rows, out_features) and y.dtype == torch.float32
            assert ((y.double() - exact).abs() <= bound).all(), (wide, rows)


@needs_kernel
def test_a_row_is_bitwise_the_same_whatever_the_rows_beside_it_and_on_either_path(monkeypatch):
    g = torch.Generator().manual_seed(7)
    w, bias = torch.randn(70, 333, generator=g), torch.randn(70, generator=g)
    packed = LIB.pack(w)
    x = torch.randn(33, 333, generator=g)
    results = []
    for wide in _paths():
        monkeypatch.setattr(LIB, "wide", wide)
        alone = torch.stack([LIB.linear(x[i:i + 1].contiguous(), packed, 70, bias)[0] for i in range(33)])
        for rows in (2, 3, 5, 8, 9, 17, 33):  # every chunking of the rows
            assert torch.equal(LIB.linear(x[:rows].contiguous(), packed, 70, bias), alone[:rows]), (wide, rows)
        results.append(alone)
    assert all(torch.equal(r, results[0]) for r in results)  # one FMA lane per element, in order: the same bits


@needs_kernel
def test_a_strided_weight_packs_as_its_contiguous_copy_and_other_weights_are_refused():
    w = torch.randn(40, 64)[:, :50]  # a row stride of 64
    assert torch.equal(LIB.pack(w), LIB.pack(w.contiguous()))
    for bad in (torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8).t(), torch.randn(8)):
        with pytest.raises(ValueError, match="float32"):
            LIB.pack(bad)


@needs_kernel
def test_a_packed_linear_on_the_kernel_is_batch_invariant_and_follows_its_weight(monkeypatch):
    layer = torch.nn.Linear(48, 67).eval()
    linear.prepare_linears([layer], CpuOptions())
    k = layer.kernels
    monkeypatch.setattr(k, "choice", ("smallm",) * linear.SMALL_MAX_ROWS)
    monkeypatch.setattr(k, "lib", LIB)
    x = torch.randn(1, 8, 48)
    with torch.inference_mode():
        whole = layer(x)
        for i in range(8):
            assert torch.equal(layer(x[:, i:i + 1]), whole[:, i:i + 1])
        torch.testing.assert_close(whole, torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        layer.weight.mul_(-0.5)  # in place: the packed copy is made again
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5,
                                   atol=1e-5)


def test_the_library_is_built_once_into_the_cache_folder(tmp_path, monkeypatch):
    if smallm.why_unavailable() is not None:
        pytest.skip(smallm.why_unavailable())
    monkeypatch.setattr(smallm, "_LOADED", {})
    lib = smallm.library(str(tmp_path))
    assert lib is not None and lib.path.startswith(str(tmp_path / "smallm"))
    built = list((tmp_path / "smallm").iterdir())
    assert [p.name for p in built] == [lib.path.rsplit("/", 1)[1]]  # no temporary file left
    monkeypatch.setattr(smallm, "_LOADED", {})
    calls = []
    monkeypatch.setattr(smallm.subprocess, "run", lambda *a, **k: calls.append(a))
    assert smallm.library(str(tmp_path)).path == lib.path and not calls  # found, not compiled again


@pytest.mark.parametrize("failure", ["no_avx2", "gcc_fails"])
def test_where_the_kernel_cannot_be_built_it_is_not_offered_and_the_log_says_why(tmp_path, monkeypatch, caplog,
                                                                                 failure):
    monkeypatch.setattr(smallm, "_LOADED", {})
    if failure == "no_avx2":
        monkeypatch.setattr(smallm.torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    else:
        monkeypatch.setattr(smallm, "why_unavailable", lambda: None)
        monkeypatch.setattr(smallm, "FLAGS", ("-O3", "--no-such-flag"))
    monkeypatch.setattr(smallm, "compile_cache_dir", lambda options: str(tmp_path))
    layer = torch.nn.Linear(24, 40).eval()
    with caplog.at_level(logging.INFO, logger=smallm.__name__):
        k = linear.prepare_linears([layer], CpuOptions())[linear.shape_key(layer.weight)]
    assert "smallm" not in k.choice and k.lib is None
    want = "no AVX2" if failure == "no_avx2" else "gcc failed"
    assert any("no small-M linear kernel" in r.getMessage() and want in r.getMessage() for r in caplog.records)
    assert not list(tmp_path.rglob("*.so"))
