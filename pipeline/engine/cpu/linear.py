"""Linear layers on the CPU: each weight shape's kernel for each small row count, chosen at load.

Why.  With PyTorch's default path, ``F.linear`` on 2-3 rows of input runs MKL's
matrix-vector kernel once per row, so a verification pass over a few tokens costs a few
decoding steps, although it reads the same weights.  oneDNN with the weight packed once into its
blocked layout reads the weight once for a few rows (and so does a one-row step); which kernel
is fastest for 1-8 rows (a decoding step up to a k = 7 verification pass) depends on the CPU
and the shape, so it is measured at load over the model's own weights of that shape, among:

- ``onednn``: ``torch.ops.mkldnn._linear_pointwise`` on a packed copy of the weight (the
  default, and the kernel for more rows; off: ``F.linear``);
- ``mkl``: ``F.linear``;
- ``transposed``: MKL's ``x @ W^T`` with ``W^T`` kept ``(in, out)`` contiguous (no horizontal
  sums; a copy kept only for the shapes that take it);
- ``rowdot``: a dot product per weight row (:func:`.compiling.products`) compiled by inductor
  into one loop that streams the weight at memory speed (float32 weights of
  :data:`.compiling.INDUCTOR_MIN_ELEMENTS` or more; 1 .. :data:`ROWDOT_MAX_ROWS` rows, one
  compiled graph per row count), where ``smallm`` is not offered (it was as fast or faster at
  every shape and row count measured, without a graph to compile per shape and row count);
- ``smallm``: :mod:`.smallm`'s C kernel on a copy of the weight packed once into K-major panels
  of 16 output columns, which reads the weight once for 8 rows and more (float32, a CPU with AVX2
  and FMA, gcc at hand; its sums are bitwise the same whatever the row count).

Where oneDNN cannot pack bfloat16 (a CPU without AVX-512 BW/VL/DQ or AVX-NE-CONVERT), ``F.linear``
in bfloat16 runs at a fraction of float32's speed; there an input of
:data:`BF16_UPCAST_MIN_ROWS` rows or more is computed in float32 (input and weight widened
exactly, the result rounded to bfloat16 once) and fewer rows keep ``F.linear``.

The copies (packed, transposed) are made from the layer's weight and made again when the weight
changes (:func:`weight_version`); the model's own weights are kept, so tied embeddings,
``state_dict`` and saving go on working.  Measurements: ``docs/benchmarks.md``.
"""

from __future__ import annotations

import weakref
from typing import Iterable

import torch
import torch.nn.functional as F

from . import smallm
from .compiling import INDUCTOR_MIN_ELEMENTS, compile_graph, products
from .measure import Costs, best_of, fastest
from .options import CpuOptions


def _bf16_packable() -> bool:
    """Whether oneDNN packs bfloat16 weights on this CPU (``_reorder_linear_weight`` raises
    on an AVX2-only CPU)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(check()) if check is not None else False
    except RuntimeError:
        return False


def onednn_available() -> bool:
    """Whether this torch has oneDNN's packed linear kernels."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


#: dtypes oneDNN's packed kernels serve on this CPU
PACKED_DTYPES = (torch.float32,) + ((torch.bfloat16,) if _bf16_packable() else ())
#: dtypes whose Linear layers are prepared (bfloat16 always: packed, or widened for long inputs)
PREPARED_DTYPES = (torch.float32, torch.bfloat16)
#: bfloat16 where oneDNN cannot pack it: inputs of at least this many rows are computed in float32
#: (an AVX2 CPU: 8 rows broke even for a 1536 x 576 weight, 16 for SmolLM2's head)
BF16_UPCAST_MIN_ROWS = 32
#: rows of input the weights are packed for: oneDNN's blocked layout, not a limit
PACK_FOR_ROWS = 4
#: the most rows of input that may go to a kernel other than the default (k + 1 rows for k = 7)
SMALL_MAX_ROWS = 8
#: the most rows of input the row-dot kernel is offered for (each count is one more graph to compile)
ROWDOT_MAX_ROWS = 5
#: the kernels, in the order they are listed
KERNELS = ("onednn", "mkl", "transposed", "rowdot", "smallm")


def weight_version(w: torch.Tensor) -> tuple[int, int]:
    """What identifies a weight's values: its storage and in-place version (an inference tensor
    has no version counter, and cannot change outside inference mode).  Two integers: the lean
    pass checks every source weight's on every pass."""
    try:
        return w.data_ptr(), w._version
    except RuntimeError:
        return w.data_ptr(), -1


class ShapeKernels:
    """The kernels of one weight shape and dtype: which one serves 1 ..
    :data:`SMALL_MAX_ROWS` rows of input (``choice[rows - 1]``), the default for more, the
    compiled row-dot functions by row count, the small-M kernel's library (``lib``), and each
    layer's copies of its weight.

    Shared by the layers of the shape.  A deep copy of a layer shares it (the copy makes its own
    weight copies at its first call); pickled, it keeps its choice and drops compiled code,
    library and copies (a row count whose row-dot or small-M kernel is gone takes ``F.linear``)."""

    def __init__(self, shape: tuple[int, int], dtype: torch.dtype, default: str,
                 choice: tuple[str, ...] | None = None):
        self.shape, self.dtype, self.default = tuple(shape), dtype, default
        self.choice = tuple(choice) if choice is not None else (_small_default(default),) * SMALL_MAX_ROWS
        self.rowdot: dict[int, object] = {}
        self.lib: smallm.Library | None = None
        self.layers = 0
        self._copies: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()

    def __deepcopy__(self, memo) -> "ShapeKernels":
        return self

    def __reduce__(self):
        return (ShapeKernels, (self.shape, self.dtype, self.default, self.choice))

    def copy(self, layer: torch.nn.Linear, kind: str) -> torch.Tensor:
        """``layer``'s weight packed for oneDNN (``"packed"``), transposed ``(in, out)``
        contiguous (``"transposed"``) or packed for the small-M kernel (``"smallm"``), made again
        when the weight changed."""
        w = layer.weight
        key = weight_version(w)
        kept = self._copies.setdefault(layer, {})
        entry = kept.get(kind)
        if entry is None or entry[0] != key:
            with torch.inference_mode(False), torch.no_grad():
                d = w.detach()
                if kind == "packed":
                    made = torch.ops.mkldnn._reorder_linear_weight(d, PACK_FOR_ROWS)
                elif kind == "smallm":
                    made = self.lib.pack(d)
                else:
                    made = d.t().contiguous()
            entry = kept[kind] = (key, made)
        return entry[1]

    def drop(self, kind: str) -> None:
        """Forget every layer's ``kind`` copies (a kernel no row count took)."""
        for kept in self._copies.values():
            kept.pop(kind, None)

    def describe(self) -> dict:
        """Plain data: ``{"shape": [out, in], "dtype", "layers", "default", "rows": {"1": kernel, ...}}``."""
        return {"shape": list(self.shape), "dtype": str(self.dtype).removeprefix("torch."), "layers": self.layers,
                "default": self.default, "rows": {str(i + 1): k for i, k in enumerate(self.choice)}}


def _small_default(default: str) -> str:
    return "mkl" if default == "widen" else default  # short bfloat16 inputs keep F.linear


def _default_kernel(dtype: torch.dtype, options: CpuOptions) -> str:
    if dtype in PACKED_DTYPES and options.part_on("onednn") and onednn_available():
        return "onednn"
    return "widen" if dtype == torch.bfloat16 else "mkl"


class PackedLinear(torch.nn.Linear):
    """A ``torch.nn.Linear`` whose CPU inference runs its shape's kernels (:class:`ShapeKernels`,
    attribute ``kernels``).  Same parameters and ``state_dict``; made by :func:`prepare_linears`
    (a ``__class__`` swap), never constructed directly.  Autograd, another device or dtype of
    input take ``F.linear``."""

    kernels: ShapeKernels

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's name
        w = self.weight
        if (input.device.type != "cpu" or w.device.type != "cpu" or input.dtype != w.dtype
                or (torch.is_grad_enabled() and (w.requires_grad or input.requires_grad))):
            return F.linear(input, w, self.bias)
        k = self.kernels
        rows = input.numel() // w.shape[1]
        kernel = k.choice[rows - 1] if 0 < rows <= SMALL_MAX_ROWS else k.default
        if kernel == "mkl" or (kernel == "widen" and rows < BF16_UPCAST_MIN_ROWS):
            return F.linear(input, w, self.bias)
        bias = None if self.bias is None else self.bias.detach()
        if kernel == "onednn":
            return torch.ops.mkldnn._linear_pointwise(input, k.copy(self, "packed"), bias, "none", [], "")
        if kernel == "widen":
            return F.linear(input.float(), w.detach().float(), None if bias is None else bias.float()).to(w.dtype)
        x = input.reshape(rows, w.shape[1])
        if kernel == "transposed":
            wt = k.copy(self, "transposed")
            y = torch.mm(x, wt) if bias is None else torch.addmm(bias, x, wt)
        elif kernel == "smallm":
            if k.lib is None or w.stride(1) != 1:
                return F.linear(input, w, self.bias)
            y = k.lib.linear(x.contiguous(), k.copy(self, "smallm"), w.shape[0],
                             None if bias is None else bias.contiguous())
        else:  # rowdot
            dot = k.rowdot.get(rows)
            if dot is None or not w.is_contiguous():
                return F.linear(input, w, self.bias)
            y = dot(w, x.contiguous())
            if bias is not None:
                y = y + bias
        return y.reshape(*input.shape[:-1], w.shape[0])


def _run(kernel: str, k: ShapeKernels, layers: list, x: torch.Tensor):
    """A call of ``kernel`` on every layer (their weights read as a pass reads them)."""
    if kernel == "onednn":
        packed = [k.copy(m, "packed") for m in layers]
        return lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in packed]
    if kernel == "transposed":
        wts = [k.copy(m, "transposed") for m in layers]
        return lambda: [torch.mm(x, wt) for wt in wts]
    if kernel == "smallm":
        packed = [k.copy(m, "smallm") for m in layers]
        n = layers[0].weight.shape[0]
        return lambda: [k.lib.linear(x, p, n) for p in packed]
    weights = [m.weight.detach() for m in layers]
    if kernel == "rowdot":
        dot = k.rowdot[x.shape[0]]
        return lambda: [dot(w, x) for w in weights]
    return lambda: [F.linear(x, w) for w in weights]


def measure_kernels(layers: list[torch.nn.Linear], options: CpuOptions, costs: Costs | None = None) -> ShapeKernels:
    """The :class:`ShapeKernels` of ``layers`` (all of one weight shape and dtype): for each row
    count 1 .. :data:`SMALL_MAX_ROWS`, every kernel ``options`` offers timed over all the layers
    (:func:`.measure.best_of`), the default kept unless another is faster by
    :data:`.measure.MARGIN`.  Compiles the row-dot kernels it offers (1 .. :data:`ROWDOT_MAX_ROWS`
    rows) and, once per process, the small-M kernel (:func:`.smallm.library`, in the node's cache
    folder); copies and compiled code no row count took are dropped."""
    w0 = layers[0].weight
    k = ShapeKernels(w0.shape, w0.dtype, _default_kernel(w0.dtype, options))
    k.layers = len(layers)
    if k.default == "widen":
        return k
    offered = [k.default] + [name for name in ("mkl",) if name != k.default]
    if w0.dtype == torch.float32 and options.part_on("transposed"):
        offered.append("transposed")
    if w0.dtype == torch.float32 and options.part_on("smallm") and all(m.weight.stride(1) == 1 for m in layers):
        k.lib = smallm.library_for(options, costs)
        if k.lib is not None:
            offered.append("smallm")
    rowdot = (w0.dtype == torch.float32 and options.part_on("rowdot") and w0.numel() >= INDUCTOR_MIN_ELEMENTS
              and all(m.weight.is_contiguous() for m in layers) and "smallm" not in offered)
    if len(offered) == 1 and not rowdot:
        return k
    chosen = []
    with torch.inference_mode(False), torch.no_grad():
        for rows in range(1, SMALL_MAX_ROWS + 1):
            x = torch.randn(rows, w0.shape[1], dtype=w0.dtype)
            names = list(offered)
            if rowdot and rows <= ROWDOT_MAX_ROWS:
                example = (torch.zeros(tuple(w0.shape), dtype=w0.dtype), torch.zeros(rows, w0.shape[1], dtype=w0.dtype))
                dot = compile_graph(products, example, f"row-dot kernel for a {tuple(w0.shape)} weight, {rows} rows", costs)
                if dot is not None:
                    k.rowdot[rows] = dot
                    names.append("rowdot")
            times = {name: best_of(_run(name, k, layers, x), costs=costs) for name in names}
            chosen.append(fastest(times, k.default))
    k.choice = tuple(chosen)
    k.rowdot = {rows: f for rows, f in k.rowdot.items() if k.choice[rows - 1] == "rowdot"}
    for kind, kernel in (("transposed", "transposed"), ("packed", "onednn"), ("smallm", "smallm")):
        if kernel not in k.choice and kernel != k.default:
            k.drop(kind)
    if "smallm" not in k.choice:
        k.lib = None
    return k


def shape_key(w: torch.Tensor) -> tuple:
    return (tuple(w.shape), w.dtype)


def prepare_linears(modules: Iterable[torch.nn.Module], options: CpuOptions, known: dict | None = None,
                    costs: Costs | None = None, measure: bool = True) -> dict[tuple, ShapeKernels]:
    """Switch the plain ``torch.nn.Linear`` layers among ``modules`` on the CPU, of float32 or
    bfloat16, to :class:`PackedLinear`, in place, where their shape's kernels differ from
    ``F.linear``.  A shape in ``known`` (``shape_key -> ShapeKernels``) keeps its kernels;
    another is measured (:func:`measure_kernels`), or with ``measure=False`` takes its default
    kernel (layers re-made after a weight changed, outside the load).  Subclasses of
    ``Linear`` (quantized layers and the like) are left alone.

    Returns:
        ``shape_key -> ShapeKernels`` of the shapes switched, ``known`` included.
    """
    known = dict(known or {})
    by_shape: dict[tuple, list] = {}
    for m in modules:
        if type(m) is torch.nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype in PREPARED_DTYPES:
            by_shape.setdefault(shape_key(m.weight), []).append(m)
    for key, layers in by_shape.items():
        k = known.get(key)
        if k is None:
            w = layers[0].weight
            k = known[key] = (measure_kernels(layers, options, costs) if measure
                              else ShapeKernels(w.shape, w.dtype, _default_kernel(w.dtype, options)))
        elif measure:
            k.layers += len(layers)
        if k.default == "mkl" and set(k.choice) == {"mkl"}:
            known.pop(key)  # nothing to gain: the layers stay nn.Linear
            continue
        for m in layers:
            m.__class__ = PackedLinear
            m.kernels = k
    return known


def restore_linears(modules: Iterable[torch.nn.Module]) -> None:
    """Undo :func:`prepare_linears` on ``modules``: every :class:`PackedLinear` back to ``torch.nn.Linear``."""
    for m in modules:
        if type(m) is PackedLinear:
            m.__class__ = torch.nn.Linear
            m.__dict__.pop("kernels", None)
