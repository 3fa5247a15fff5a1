"""CPU kernels for the engine's passes: what makes a verification pass over a few tokens cost
about what a one-token decoding step costs, as it should where the weights are read once.

Measured on this project's 2-core AVX-512 machine (SmolLM2-135M, float32, one thread, an
800-token context): with PyTorch's default CPU path a target pass over ``n`` tokens costs
``t(2) = 1.6``, ``t(3) = 2.0`` times ``t(1)`` at one row, and at 8 rows ``t(2)`` is 4-8 times
``t(1)``.  Two causes, neither of them the physics of the pass:

1. **Linear layers.**  ``F.linear`` with 2-3 rows of input runs MKL's matrix-vector path once
   per row (``M = 3`` costs 3x ``M = 1``) and packs the weight on every call above that.
   oneDNN with the weight packed once into its blocked layout
   (``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``, the kernels
   PyTorch's inductor uses for frozen CPU models) reads the weight once whatever ``M`` is
   while ``M`` is small: a pass over 4 tokens costs about what one token costs, and one
   token costs less than before (SmolLM2's 49,152 x 576 head: 2.4 ms instead of 6.3 ms).
   :func:`pack_linears` switches every ``torch.nn.Linear`` of a model to it (float32 and
   bfloat16 on the CPU; the packed copy is repacked if the weight changes in place;
   training, autograd and other devices keep ``F.linear``).  It costs a second copy of each
   linear weight in memory, and a third where the transposed kernel below wins (the model's
   own weights are kept: tied embeddings, saving and ``state_dict`` go on working).

   Which kernel is faster for 1-5 rows depends on the CPU: on the machine of commit d397ec9
   oneDNN won from one row on (the 49,152 x 576 head: 2.4 ms against 6.3), on a later
   machine of the same project MKL's matrix-vector path won up to 3 rows (one row: 0.21 ms
   against 0.31 for a 1536 x 576 layer; a plain decode step of SmolLM2 93.6 ms with oneDNN,
   67.4 ms with MKL for its one row).  A third kernel streams the weight the other way:
   MKL's product with a transposed copy of the weight (``x @ W^T`` with ``W^T`` stored
   ``(in, out)``, contiguous), which reads it row by row in the output's direction and needs
   no horizontal sums.  On this project's AVX2 machine it is the fastest at one row for most
   of SmolLM2's shapes (one row, every weight of a shape read once as a pass reads it: the
   49,152 x 576 head 4.4 ms against 6.4 with oneDNN and 8.2 with ``F.linear``; the 3,072 x 576
   gate/up projection 0.33 ms against 0.44 and 0.55), and slower from two rows on.  So
   :func:`pack_linears` measures it: for each weight shape of the model it times the three
   kernels over the model's own weights of that shape at 1 to :data:`SMALL_MAX_ROWS` (5)
   rows of input, once per process (:func:`small_row_kernels`), and a layer sends inputs of
   that many rows to the winner; more rows always go to oneDNN, whose packed layout is made
   for them.  The
   transposed copy (float32 only) is kept only for the shapes where it won a row count.

   A fourth kernel serves 1-5 rows (decoding steps, verification passes of k <= 4) of the float32
   weights too large to stay in the L2 cache: a dot product per output row that PyTorch's inductor generates as one C++
   loop (:func:`rowdot`).  Where MKL and oneDNN read a decoding step's weights from memory at
   11-17 GB/s on this project's AMD EPYC machine, it reads them at 18-27 GB/s, and a plain
   SmolLM2 decoding step took 34.5 ms instead of 45 (one thread, 600 cached positions).  It is
   measured like the others and compiled once per shape and row count (a second or two, cached by inductor
   on disk); ``SPECBATCH_INDUCTOR=0`` leaves it out, and where it cannot be compiled the
   other three serve.

   oneDNN packs bfloat16 only on a CPU with AVX-512 BW/VL/DQ or AVX-NE-CONVERT.  On an
   AVX2-only CPU ``F.linear`` in bfloat16 runs at a fraction of float32's speed (a 145 x 576
   by 576 x 1536 product: 30 ms against 3.8 ms in float32, one thread), which makes a
   bfloat16 prefill about 8 times slower than a float32 one.  There a bfloat16 layer computes
   an input of :data:`BF16_UPCAST_MIN_ROWS` rows or more in float32 (input and weight
   widened exactly, the sum in float32 as bfloat16's kernel sums too, the result rounded to
   bfloat16: another summation order), and fewer rows (decoding, verification) keep
   ``F.linear``, which is faster there than widening the weight.
2. **Attention with grouped KV heads.**  With an explicit mask and more than one query,
   transformers' SDPA path materialises ``repeat_kv`` (every KV head copied to each of its
   query heads) for every layer and pass, which at 8 rows and an 800-token context is most
   of the pass.  :func:`small_query_attention` runs SDPA with ``enable_gqa=True`` instead
   for a short query block (``q <= SMALL_QUERY``), reading each KV head once for its group
   of query heads (transformers takes that path only where it can rule out a mask).  The
   runner uses it for its masked passes on the CPU (:func:`attention_implementation`);
   prefill passes keep SDPA's causal kernel.

Both change float32 rounding (another summation order), not the math: greedy outputs match
plain decoding exactly in float64 and, in float32, differ only at measured near-ties, as
with any other kernel choice.  ``SPECBATCH_CPU_KERNELS=0`` in the environment switches both
off (PyTorch's default kernels), e.g. to measure what they buy.
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref

import torch
import torch.nn.functional as F

#: query blocks up to this many tokens use :func:`small_query_attention` (verification passes)
SMALL_QUERY = 16
#: the attention implementation name registered with transformers
ATTENTION_NAME = "specbatch_small_query"


def _bf16_packable() -> bool:
    """Whether oneDNN packs bfloat16 weights on this CPU (it needs AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT; on an AVX2-only CPU ``_reorder_linear_weight`` raises)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(check()) if check is not None else False
    except RuntimeError:
        return False


#: dtypes oneDNN's packed linear kernels serve on this CPU (bfloat16 only where the CPU has
#: the instructions: elsewhere a bfloat16 linear stays ``F.linear``)
PACKED_DTYPES = (torch.float32,) + ((torch.bfloat16,) if _bf16_packable() else ())
#: bfloat16 where oneDNN cannot pack it: inputs of at least this many rows are computed in float32
#: (measured on an AVX2 CPU: 8 rows break even for a 1536 x 576 weight, 16 for SmolLM2's head)
BF16_UPCAST_MIN_ROWS = 32
#: M (rows of input) the weights are packed for: oneDNN's blocked GEMM layout, not a limit
PACK_FOR_ROWS = 4
#: the most rows of input :func:`small_row_kernels` may send to a kernel other than oneDNN: a
#: decoding step's single row up to a verification pass of a k = 4 draft (k + 1 rows)
SMALL_MAX_ROWS = 5
#: the kernels a row count of 1 .. SMALL_MAX_ROWS may go to: oneDNN's packed kernel, ``F.linear``
#: (MKL's matrix-vector path), MKL's product with a transposed copy of the weight, and dot
#: products per output row generated by PyTorch's inductor (:func:`rowdot`)
KERNELS = ("onednn", "mkl", "transposed", "inductor")
#: weights of at least this many elements are offered the inductor kernel: a weight
#: that does not stay in the L2 cache between passes, where streaming it at memory speed is what
#: counts (smaller ones would pay a compile, and its ~10 us call, for little)
INDUCTOR_MIN_ELEMENTS = 1 << 18
#: dtypes the transposed kernel is measured for (MKL's float32 product; bfloat16 has no such path)
TRANSPOSED_DTYPES = (torch.float32,)
#: another kernel must be faster than the one it would replace by this factor to take a row count (timing noise)
MARGIN = 0.95


def env_on(name: str) -> bool:
    """Whether the switch ``name`` in the environment is on (default on; ``0``, ``false``,
    ``no`` or ``off`` turn it off)."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


def enabled() -> bool:
    """Whether the CPU kernels are on (``SPECBATCH_CPU_KERNELS``, default on)."""
    return env_on("SPECBATCH_CPU_KERNELS")


def _onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


#: each PackedLinear's packed weight, ``(weight key, packed tensor)``, kept outside the module so
#: that copying, pickling or saving the model never meets oneDNN's opaque tensor
_PACKED: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _weight_key(w: torch.Tensor) -> tuple:
    """What identifies the weight's values: its storage, dtype and in-place version (an
    inference tensor has no version counter, and cannot be changed outside inference mode)."""
    try:
        version = w._version
    except RuntimeError:
        version = -1
    return (w.data_ptr(), version, w.dtype, tuple(w.shape))


class PackedLinear(torch.nn.Linear):
    """A ``torch.nn.Linear`` whose CPU inference runs oneDNN with a packed copy of its weight,
    or for 1-5 rows of input the kernel of :data:`KERNELS` measured fastest for its weight's shape (see the
    module docstring).  Same parameters, same ``state_dict``; instances are made by
    :func:`pack_linears` (``__class__`` swap), never constructed directly."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's name
        w = self.weight
        if (input.device.type != "cpu" or w.device.type != "cpu" or input.dtype != w.dtype
                or (torch.is_grad_enabled() and (w.requires_grad or input.requires_grad))):
            return F.linear(input, w, self.bias)
        if w.dtype not in PACKED_DTYPES:  # bfloat16 on a CPU oneDNN cannot pack it for
            if w.dtype != torch.bfloat16 or input.numel() < BF16_UPCAST_MIN_ROWS * w.shape[1]:
                return F.linear(input, w, self.bias)
            bias = self.bias.detach().float() if self.bias is not None else None
            return F.linear(input.float(), w.detach().float(), bias).to(torch.bfloat16)
        bias = self.bias.detach() if self.bias is not None else None
        rows = input.numel() // w.shape[1]
        if rows <= SMALL_MAX_ROWS:
            kernel = _SMALL_ROWS.get(_shape_key(w), KERNELS[:1] * SMALL_MAX_ROWS)[rows - 1] if rows else "mkl"
            if kernel == "mkl":
                return F.linear(input, w, self.bias)
            if kernel == "inductor" and w.is_contiguous() and (dot := rowdot(w, rows)) is not None:
                y = dot(w, input.reshape(_rowdot_input_shape(rows, w.shape[1])).contiguous()).contiguous()
                if bias is not None:
                    y = y + bias
                return y.view(*input.shape[:-1], w.shape[0])
            if kernel == "transposed":
                x = input.reshape(rows, w.shape[1])
                wt = _transposed(self)
                y = torch.mm(x, wt) if bias is None else torch.addmm(bias, x, wt)
                return y.view(*input.shape[:-1], w.shape[0])
        return torch.ops.mkldnn._linear_pointwise(input, _packed(self), bias, "none", [], "")


def _packed(layer: torch.nn.Linear) -> torch.Tensor:
    """``layer``'s weight in oneDNN's packed layout (packed again when the weight changed)."""
    return _copy(_PACKED, layer, lambda w: torch.ops.mkldnn._reorder_linear_weight(w, PACK_FOR_ROWS))


def _transposed(layer: torch.nn.Linear) -> torch.Tensor:
    """``layer``'s weight transposed, ``(in, out)`` contiguous (made again when the weight changed)."""
    return _copy(_TRANSPOSED, layer, lambda w: w.t().contiguous())


def _copy(store: "weakref.WeakKeyDictionary", layer: torch.nn.Linear, make) -> torch.Tensor:
    w = layer.weight
    key = _weight_key(w)
    kept = store.get(layer)
    if kept is None or kept[0] != key:
        with torch.no_grad():
            kept = (key, make(w.detach()))
        store[layer] = kept
    return kept[1]


def _rowdot_input_shape(rows: int, in_features: int) -> tuple[int, ...]:
    """The input :func:`rowdot`'s kernels take: ``(in,)`` for one row (the loop measured fastest), ``(rows, in)``."""
    return (rows, in_features) if rows > 1 else (in_features,)


def _dot_rows(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # rows of input inner, ``(out, rows)`` transposed: inductor's loop then reads each row of
    # ``w`` once for all rows of input (rows outer read it once per row: 2-4 rows cost 1.4-2x)
    return (w * x).sum(-1) if x.dim() == 1 else (w[:, None, :] * x).sum(-1).t()


#: per (weight shape, dtype, torch threads, rows of input): the compiled kernel of :func:`rowdot`, or None where it could not be made
_ROWDOT: dict[tuple, object] = {}


def rowdot(w: torch.Tensor, rows: int = 1):
    """A kernel ``(w, x) -> x @ w^T`` for weights of ``w``'s shape and dtype and ``rows`` rows
    of input, or ``None`` where it cannot be made (no C++ compiler, say): PyTorch's inductor
    compiles ``(w * x).sum(-1)`` into one C++ loop that reads each row of ``w`` contiguously
    and sums its products in vector registers, without the intermediate product.  For 2-5
    rows the loop runs over the rows of input inside each row of ``w``, so the weight is read
    once whatever the rows: SmolLM2's 3,072 x 576 layers at 4 rows took 11.2 ms against 13.1
    with oneDNN and 20.7 with the rows outside (30 layers, one thread); for its 576 x 1536
    layers oneDNN stays faster from 3 rows on, and the measurement keeps it there.

    Why.  One row of input is a matrix-vector product, which reads every weight once and is
    bound by memory.  On this project's AMD EPYC machine (one thread, the weights of a
    decoding step streamed from memory, not from the cache) MKL's and oneDNN's matrix-vector
    kernels read SmolLM2's weights at 11-17 GB/s and MKL's transposed product at 13-20, where a
    plain sum over the same weights reads 28-31 GB/s; this loop reads them at 18-27 GB/s
    (``bench/bench_llamacpp.py``).  It is made without TorchDynamo (``make_fx`` then
    ``compile_fx``), so a call costs about 10 us of Python, not the ~30 us of a
    ``torch.compile``'d function's guards.

    Args:
        w: an ``(out, in)`` contiguous weight on the CPU (only its shape and dtype are used).
        rows: rows of input, 1 .. :data:`SMALL_MAX_ROWS`.

    Returns:
        A callable of ``w`` ``(out, in)`` and ``x`` contiguous, ``(in,)`` for one row and
        ``(rows, in)`` for more, both of ``w``'s dtype, that returns ``(out,)`` or
        ``(rows, out)``; compiled once per shape, dtype, torch thread count and ``rows``
        in a process (inductor's own cache keeps the C++ across processes).  Another
        summation order than MKL's: the same math, float32 rounding differs.
    """
    key = _shape_key(w) + (rows,)
    if key not in _ROWDOT:
        fn = None
        try:
            from torch._inductor.compile_fx import compile_fx
            from torch.fx.experimental.proxy_tensor import make_fx

            example = (torch.zeros(w.shape, dtype=w.dtype),
                       torch.zeros(_rowdot_input_shape(rows, w.shape[1]), dtype=w.dtype))
            with torch.inference_mode(False), torch.no_grad():
                fn = compile_fx(make_fx(_dot_rows)(*example), list(example))
        except Exception as exc:  # noqa: BLE001 - any failure to compile leaves the other kernels
            import logging

            logging.getLogger(__name__).info("no inductor kernel for a %s weight: %s", tuple(w.shape), exc, exc_info=True)
        _ROWDOT[key] = fn
    return _ROWDOT[key]


#: each PackedLinear's transposed weight where its shape's measurement chose that kernel, ``(weight key, tensor)``
_TRANSPOSED: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _shape_key(w: torch.Tensor) -> tuple:
    return (tuple(w.shape), w.dtype, torch.get_num_threads())


#: per (weight shape, dtype, torch threads): the kernel (one of :data:`KERNELS`) for inputs of 1 .. SMALL_MAX_ROWS rows
_SMALL_ROWS: dict[tuple, tuple[str, ...]] = {}


def small_row_kernels(layers: list[torch.nn.Linear], repeats: int = 3) -> tuple[str, ...]:
    """Which kernel of :data:`KERNELS` serves inputs of 1 .. :data:`SMALL_MAX_ROWS` rows fastest
    for these layers (all of one weight shape and dtype): each kernel timed over all of them
    (their weights read as a pass reads them, not one weight hot in cache), best of
    ``repeats``, at each row count.  oneDNN is the default, and another kernel takes a row
    count only when faster by :data:`MARGIN`; the transposed kernel is tried for
    :data:`TRANSPOSED_DTYPES` only, and its copies are dropped again where it won no row
    count; the inductor kernel (:func:`rowdot`) is tried for float32 weights of
    :data:`INDUCTOR_MIN_ELEMENTS` or more, unless ``SPECBATCH_INDUCTOR=0``.  Measured once per shape, dtype and torch thread count in a process, and
    remembered.

    Returns:
        ``SMALL_MAX_ROWS`` kernel names, the one for inputs of ``i + 1`` rows at ``i``
        (``numel == rows * in_features``).
    """
    key = _shape_key(layers[0].weight)
    if key in _SMALL_ROWS:
        return _SMALL_ROWS[key]
    weights = [m.weight.detach() for m in layers]
    packed = [_packed(m) for m in layers]
    transposed = [_transposed(m) for m in layers] if weights[0].dtype in TRANSPOSED_DTYPES else None

    def best(run) -> float:
        run()  # warm
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            run()
            times.append(time.perf_counter() - t)
        return min(times)

    chosen = []
    with torch.no_grad():
        for m in range(1, SMALL_MAX_ROWS + 1):
            x = torch.randn(m, weights[0].shape[1], dtype=weights[0].dtype)
            times = {"onednn": best(lambda x=x: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                                                 for p in packed]),
                     "mkl": best(lambda x=x: [F.linear(x, w) for w in weights])}
            if transposed is not None:
                times["transposed"] = best(lambda x=x: [torch.mm(x, wt) for wt in transposed])
            if (weights[0].dtype in TRANSPOSED_DTYPES and weights[0].numel() >= INDUCTOR_MIN_ELEMENTS
                    and all(w.is_contiguous() for w in weights) and env_on("SPECBATCH_INDUCTOR")
                    and (dot := rowdot(weights[0], m)) is not None):
                times["inductor"] = best(lambda x=x.view(_rowdot_input_shape(m, x.shape[1])): [dot(w, x) for w in weights])
            kernel = KERNELS[0]  # oneDNN unless another wins by the margin
            for other in KERNELS[1:]:
                if other in times and times[other] < MARGIN * times[kernel]:
                    kernel = other
            chosen.append(kernel)
    if "transposed" not in chosen:
        for layer in layers:
            _TRANSPOSED.pop(layer, None)
    _SMALL_ROWS[key] = tuple(chosen)
    return _SMALL_ROWS[key]


def pack_linears(model: torch.nn.Module) -> int:
    """Switch every plain ``torch.nn.Linear`` of ``model`` on the CPU to :class:`PackedLinear`.

    Subclasses of ``Linear`` (quantized layers and the like) are left alone, and so is a model
    on another device or of another dtype (its layers keep ``F.linear``).  Each weight shape's
    kernel for 1-5 rows of input is measured here, once per process
    (:func:`small_row_kernels`), which packs those layers' weights.  bfloat16 layers on a CPU
    where oneDNN cannot pack bfloat16 are switched too: they widen long inputs to float32
    (:data:`BF16_UPCAST_MIN_ROWS`) and keep no packed copy.

    Returns:
        How many layers were switched (0 when the kernels are off or oneDNN is missing).
    """
    if not enabled() or not _onednn_available():
        return 0
    by_shape: dict[tuple, list] = {}
    for module in model.modules():
        if (type(module) is torch.nn.Linear and module.weight.device.type == "cpu"
                and module.weight.dtype in PACKED_DTYPES + (torch.bfloat16,)):
            module.__class__ = PackedLinear
            by_shape.setdefault(_shape_key(module.weight), []).append(module)
    for layers in by_shape.values():
        if layers[0].weight.dtype in PACKED_DTYPES:  # (unpackable bfloat16 is widened, see BF16_UPCAST_MIN_ROWS)
            small_row_kernels(layers)
    return sum(map(len, by_shape.values()))


def small_query_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          is_causal: bool | None = None, **kwargs):
    """Attention of a short query block against a KV cache with grouped KV heads, without
    copying the KV heads: PyTorch's SDPA with ``enable_gqa=True`` (each KV head read once
    for its group of query heads), the path transformers takes when it can rule out a mask.

    Args:
        query: ``(b, H_q, q, d)``; key, value: ``(b, H_kv, S, d)`` with ``H_q = g * H_kv``.
        attention_mask: additive float mask ``(b or 1, 1, q, S)`` (0 = read, a large
            negative value = hidden), as the runner builds it.

    Returns:
        ``((b, q, H_q, d) output, None)``, the signature of transformers' attention functions.
        Anything this path does not cover (a long query block, no mask, dropout,
        soft-capping, attention sinks, position bias, another device) goes to transformers'
        own SDPA function.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q = query.shape[2]
    if (q > SMALL_QUERY or attention_mask is None or dropout or kwargs.get("softcap") is not None
            or kwargs.get("s_aux") is not None or kwargs.get("position_bias") is not None
            or query.device.type != "cpu" or query.shape[1] % key.shape[1]):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask[..., : key.shape[2]],
                                         scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


_registered = False


def _register() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, small_query_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    _registered = True


def uses_small_query_attention(model) -> bool:
    """Whether the runner's masked passes of ``model`` go through :func:`small_query_attention`:
    the kernels are on, the model is on the CPU and uses SDPA."""
    config = getattr(model, "config", None)
    impl = getattr(config.get_text_config() if hasattr(config, "get_text_config") else config, "_attn_implementation", None)
    return enabled() and impl == "sdpa" and getattr(model, "device", torch.device("cpu")).type == "cpu"


@contextlib.contextmanager
def attention_implementation(model, active: bool):
    """Run ``model``'s attention layers with :func:`small_query_attention` inside the block
    (when ``active``): the configs' ``_attn_implementation`` is switched for the call and
    restored after it."""
    if not active:
        yield
        return
    _register()
    config = model.config
    configs = {id(c): c for c in (config, config.get_text_config() if hasattr(config, "get_text_config") else config)}
    saved = [(c, c._attn_implementation_internal) for c in configs.values()]
    for c, _ in saved:
        c._attn_implementation_internal = ATTENTION_NAME
    try:
        yield
    finally:
        for c, old in saved:
            c._attn_implementation_internal = old
