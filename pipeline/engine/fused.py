"""A lean forward pass for Llama-architecture models on the CPU: the same math as
transformers' ``LlamaForCausalLM``, without its per-module Python and with fused projections.

Why.  Around the arithmetic of a decoding step, transformers' eager model code runs per layer
seven ``nn.Linear`` calls, two RMSNorm modules, the attention-function dispatch, keyword
plumbing and decorators.  Measured (``bench/bench_llamacpp.py``, SmolLM2-135M, one row, one
thread, CPU clock): plain decoding 28.4 tokens/s through transformers' forward, 32.1 through
this pass in the same run (1.13x); llama.cpp 46.5 on the same machine.

What.  Per decoder layer::

    h = rms_norm(x);  q, k, v = split(h @ W_qkv^T);  q, k = rope(q, k)
    k, v = cache.update(k, v, layer)          # the SlotCache, exactly as the model would
    x = x + o_proj(sdpa(q, k, v, mask))        # grouped-query heads, folded in a verification pass
    h = rms_norm(x);  g, u = split(h @ W_gate_up^T);  x = x + down_proj(silu(g) * u)

then the final norm and the output layer over the kept positions only.  ``W_qkv`` and
``W_gate_up`` are the model's own weights concatenated once (re-made if a weight is replaced or
changed in place), and go through :mod:`pipeline.engine.kernels`' packed linear kernels like every other
layer: one matrix product reads the three (two) weights where the model makes three (two).
RMSNorm, RoPE (the model's own rotary module, so every RoPE type it supports), the mask and
the cache are the model's: the output equals the model's forward up to floating-point
summation order (float64: within 1e-12; tests/engine/test_fused.py).

A pass of 1-2 tokens in all (a one-row decoding step, a k = 1 verification pass, a two-row
decoding step) runs each layer outside attention as three graphs compiled by PyTorch's inductor instead, each
matrix product fused with the element-wise ops around it and reading each weight once for all
the tokens, where measured faster (:data:`COMPILED_LAYER`): SmolLM2's plain one-row decoding
step 32.7 -> 27.9 ms, a two-token pass 38.1 -> 32.0 ms.

Where.  :meth:`pipeline.engine.runner.ModelRunner.forward` takes this path for its own model
when :func:`supports` holds (a ``LlamaForCausalLM`` with SDPA attention, full attention in
every layer, SiLU, no projection biases, no tensor-parallel slicing, on the CPU, with the CPU
kernels on: ``SPECBATCH_CPU_KERNELS``; ``SPECBATCH_FUSED=0`` turns this pass alone off) and
the pass asks for nothing else: no autograd (``torch.no_grad`` or ``inference_mode``, as the
engine runs), token ids in, logits and hidden states (``output_hidden_states``,
as the eagle head's and MTP's target passes ask) out, no forward hooks on the model other
than transformers' own (early exit's capture hook takes the model's forward).  Anything else
runs the model's forward, as before.

Memory: a copy of the attention and MLP input projections (``W_qkv``, ``W_gate_up``: about half
of a Llama's linear weights) and its packed copy, besides the model's weights and their packed
copies (:mod:`pipeline.engine.kernels`).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from . import kernels

#: the model classes this pass implements (their forward is the reference)
SUPPORTED_CLASSES = ("LlamaForCausalLM",)

#: Passes of 2 to this many query tokens per row (verification passes) fold each key/value head's
#: query heads into the query length for SDPA instead of its grouped-query kernel (``enable_gqa``),
#: which costs up to twice as much from two query tokens on (bench/bench_attention.py: SmolLM2's
#: 9 query and 3 key/value heads, 8 rows, 600 cached positions).  One token costs the same both
#: ways, and a long prefill a few percent more folded (its tiled mask is large).
FOLD_MAX_QUERY = 16

#: per model, its fused projections (kept outside the module: saving or copying the model never meets them)
_FUSED: "weakref.WeakKeyDictionary[torch.nn.Module, _Fused]" = weakref.WeakKeyDictionary()


def enabled() -> bool:
    """Whether the lean pass is on: the CPU kernels are (``SPECBATCH_CPU_KERNELS``) and
    ``SPECBATCH_FUSED`` is not ``0`` (default on; ``0`` measures what it buys)."""
    return kernels.enabled() and kernels.env_on("SPECBATCH_FUSED")


def supports(model) -> bool:
    """Whether :func:`forward` computes ``model``'s forward (see the module docstring)."""
    if type(model).__name__ not in SUPPORTED_CLASSES or not enabled():
        return False
    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        return False
    if getattr(config, "hidden_act", None) != "silu" or getattr(config, "pretraining_tp", 1) != 1:
        return False
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or ())):
        return False
    w = model.lm_head.weight
    return w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16, torch.float64)


#: per model, its modules (listed once: walking the module tree on every pass cost about 1 ms)
_MODULES: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()


def has_hooks(model) -> bool:
    """Whether ``model`` or any of its modules has forward hooks (which this pass would not
    call), global ones included, other than transformers' own: it installs output-capturing
    hooks on the layers at the first ``output_hidden_states`` call, which record only while
    such a call runs."""
    from torch.nn.modules import module as nn_module

    modules = _MODULES.get(model)
    if modules is None:
        modules = _MODULES[model] = list(model.modules())
    sets = [nn_module._global_forward_hooks, nn_module._global_forward_pre_hooks]
    sets += [hooks for m in modules for hooks in (m._forward_hooks, m._forward_pre_hooks) if hooks]
    return any(not getattr(h, "__module__", "").startswith("transformers.") for hooks in sets for h in hooks.values())


#: Passes of 1 to :data:`COMPILED_MAX_TOKENS` (2) tokens in all (one-row decoding steps,
#: verification passes of k = 1 at one row, decoding steps of 2 rows) run each decoder layer
#: outside attention as three graphs compiled by PyTorch's inductor (:func:`_graphs`), where the
#: eager layer runs about thirty small ops around its matrix products (RMSNorm, RoPE, residuals,
#: SiLU; a few microseconds of dispatch each, whatever their size): ``rms_norm -> QKV -> RoPE``,
#: ``o_proj + residual`` and ``rms_norm -> gate/up -> silu * up -> down + residual``.  Each
#: product is one dot product per weight row and token (:func:`_products`), which inductor fuses
#: into one loop over the weight's rows that reads each row once for all the pass's tokens.  The
#: products' inputs (the norms' outputs, ``silu * up``) are graph outputs too, so that inductor
#: computes them once into a buffer instead of inlining them into every weight row's loop (which
#: cost 2-3x from 3 tokens on).  ``None``: measured once per token count, weight shape and dtype
#: in a process (:func:`_compiled`), for float32 weights of :data:`kernels.INDUCTOR_MIN_ELEMENTS`
#: or more unless ``SPECBATCH_INDUCTOR=0``; ``True`` / ``False`` force it on or off (tests).
COMPILED_LAYER: bool | None = None
#: The most tokens a pass may have to run the compiled layer.  SmolLM2-135M's whole one-row
#: pass at 550 cached positions, compiled / eager (one thread, CPU clock, best of 3 x 10):
#: 1 token 27.9 / 32.7 ms (0.85x), 2 tokens 32.0 / 38.1 (0.84x), 3 tokens 0.96x, 4 and 5 tokens
#: 1.04x and 1.03x: from 4 tokens the fused MLP loop (22-23 ms) is slower than the layers' own
#: kernels (about 20), though the layer timed alone (``_time_layer``, without attention between
#: the layers) put them at 0.8x.  So the measurement decides up to here, and more tokens keep
#: the eager layer.
COMPILED_MAX_TOKENS = 2

#: per (shapes, dtype, eps, torch threads, tokens): the three compiled graphs, or None where they cannot be made
_GRAPHS: dict[tuple, tuple | None] = {}
#: per the same key: whether the compiled graphs were measured faster than the eager layer
_CHOICE: dict[tuple, bool] = {}


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm``, op for op: computed in float32 whatever ``x``'s dtype."""
    h = x.to(torch.float32)
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _products(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x @ w^T`` of ``(n, in)`` ``x`` as ``n`` dot products per row of ``w``: inductor fuses them
    into one loop that reads each row of ``w`` once (``(w[:, None] * x).sum(-1)`` reduces over
    a strided layout and was 2x slower)."""
    return torch.stack([(w * x[j]).sum(-1) for j in range(x.shape[0])])


def _attention_in(x, norm, w_qkv, cos, sin, *, eps: float, nq: int, nk: int, d: int):
    """``(n, H)`` hidden states, ``(n, d)`` cos/sin -> ``(n, heads, d)`` queries and keys after
    RoPE, ``(n, kv heads, d)`` values (and the norm's output, to keep it one buffer)."""
    h = _rms(x, norm, eps)
    qkv = _products(w_qkv, h)
    qk = qkv[:, : nq + nk].reshape(x.shape[0], -1, d)
    qk = qk * cos[:, None] + _rotate_half(qk) * sin[:, None]
    return qk[:, : nq // d], qk[:, nq // d:], qkv[:, nq + nk:].reshape(x.shape[0], -1, d), h


def _attention_out(x, o, w_o):
    """``x + o_proj(o)`` for ``(n, H)`` ``x`` and the ``(n, heads * d)`` attention output ``o``."""
    return x + _products(w_o, o)


def _mlp(x, norm, w_gate_up, w_down, *, eps: float, inter: int):
    """``x + down(silu(gate(h)) * up(h))``, ``h = rms_norm(x)``, for ``(n, H)`` ``x`` (and ``h``
    and ``silu(gate) * up``, to keep each one buffer)."""
    h = _rms(x, norm, eps)
    gu = _products(w_gate_up, h)
    a = F.silu(gu[:, :inter]) * gu[:, inter:]
    return x + _products(w_down, a), a, h


def _key(fused: "_Fused", tokens: int) -> tuple:
    layer = fused.layers[0]
    w = fused.qkv[0].weight
    return (tuple(w.shape), tuple(fused.gate_up[0].weight.shape), fused.splits, layer.self_attn.head_dim,
            float(layer.input_layernorm.variance_epsilon), w.dtype, torch.get_num_threads(), tokens)


def _graphs(fused: "_Fused", tokens: int):
    """The three compiled graphs of a layer (``attention_in``, ``attention_out``, ``mlp``) for
    passes of ``tokens`` tokens in all (any number; :func:`_compiled` offers 1 ..
    :data:`COMPILED_MAX_TOKENS`), or ``None`` where inductor cannot make them (no C++
    compiler, say).  Made without TorchDynamo (``make_fx`` then ``compile_fx``, as
    :func:`kernels.rowdot`): a call costs about 10 us of Python.  Compiled once per key in a
    process; inductor's own cache keeps the C++ across processes."""
    key = _key(fused, tokens)
    if key not in _GRAPHS:
        graphs = None
        try:
            from functools import partial

            from torch._inductor.compile_fx import compile_fx
            from torch.fx.experimental.proxy_tensor import make_fx

            layer, (nq, nk, nv), d = fused.layers[0], fused.splits, fused.layers[0].self_attn.head_dim
            eps, dtype = float(layer.input_layernorm.variance_epsilon), fused.qkv[0].weight.dtype
            hidden, inter, n = fused.qkv[0].weight.shape[1], fused.inter, tokens

            def zeros(*shape):
                return torch.zeros(shape, dtype=dtype)

            examples = (
                (partial(_attention_in, eps=eps, nq=nq, nk=nk, d=d),
                 (zeros(n, hidden), zeros(hidden), zeros(nq + nk + nv, hidden), zeros(n, d), zeros(n, d))),
                (_attention_out, (zeros(n, hidden), zeros(n, nq), zeros(hidden, nq))),
                (partial(_mlp, eps=eps, inter=inter),
                 (zeros(n, hidden), zeros(hidden), zeros(2 * inter, hidden), zeros(hidden, inter))),
            )
            with torch.inference_mode(False), torch.no_grad():
                graphs = tuple(compile_fx(make_fx(fn)(*ex), list(ex)) for fn, ex in examples)
        except Exception as exc:  # noqa: BLE001 - any failure to compile leaves the eager layer
            import logging

            logging.getLogger(__name__).info("no compiled layer for %d tokens: %s", tokens, exc, exc_info=True)
        _GRAPHS[key] = graphs
    return _GRAPHS[key]


def _compiled(fused: "_Fused", tokens: int):
    """The compiled graphs that passes of ``tokens`` tokens in all run (see
    :data:`COMPILED_LAYER`), or ``None`` for the eager layer.  Measured: both ways timed over all
    the model's layers (their weights read as a pass reads them), best of 3; the compiled layer
    must be faster by :data:`kernels.MARGIN`."""
    if not 1 <= tokens <= COMPILED_MAX_TOKENS:
        return None
    if COMPILED_LAYER is not None:
        return _graphs(fused, tokens) if COMPILED_LAYER and _usable(fused) else None
    key = _key(fused, tokens)
    if key not in _CHOICE:
        w = fused.qkv[0].weight
        _CHOICE[key] = False
        if (w.dtype == torch.float32 and w.numel() >= kernels.INDUCTOR_MIN_ELEMENTS and kernels.env_on("SPECBATCH_INDUCTOR")
                and _usable(fused) and _graphs(fused, tokens) is not None):
            _CHOICE[key] = (_time_layer(fused, tokens, compiled=True)
                            < kernels.MARGIN * _time_layer(fused, tokens, compiled=False))
    return _graphs(fused, tokens) if _CHOICE[key] else None


def _usable(fused: "_Fused") -> bool:
    """Whether every weight the compiled layer reads is contiguous, as its kernels take them."""
    return all(m.weight.is_contiguous() for layer in fused.layers for m in (layer.self_attn.o_proj, layer.mlp.down_proj))


def _attention_in_of(fused: "_Fused", i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, graphs
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer ``i``'s ``(b, heads, Q, d)`` queries, keys and values of the ``(b, Q, H)`` ``x``
    (input norm, QKV, RoPE): through the compiled ``graphs``, or the eager ops (``None``)."""
    layer = fused.layers[i]
    b, q_len = x.shape[:2]
    nq, nk, _ = fused.splits
    d = layer.self_attn.head_dim
    if graphs is not None:
        n = b * q_len
        q, k, v, _ = graphs[0](x.reshape(n, -1), layer.input_layernorm.weight, fused.qkv[i].weight,
                               cos.reshape(n, d).contiguous(), sin.reshape(n, d).contiguous())
        return tuple(t.reshape(b, q_len, -1, d).transpose(1, 2) for t in (q, k, v))
    qkv = fused.qkv[i](_rms_norm(layer.input_layernorm, x))
    qk = qkv[..., :nq + nk].view(b, q_len, -1, d).transpose(1, 2)  # the query heads, then the key heads
    qk = qk * cos + _rotate_half(qk) * sin  # RoPE on both at once
    return qk[:, : nq // d], qk[:, nq // d:], qkv[..., nq + nk:].view(b, q_len, -1, d).transpose(1, 2)


def _attention_out_of(fused: "_Fused", i: int, x: torch.Tensor, o: torch.Tensor, graphs) -> torch.Tensor:
    """``x + o_proj(o)`` of layer ``i``, for the ``(b, heads, Q, d)`` attention output ``o``."""
    proj = fused.layers[i].self_attn.o_proj
    b, q_len = x.shape[:2]
    o = o.transpose(1, 2).reshape(b * q_len, -1)
    if graphs is not None:
        return graphs[1](x.reshape(b * q_len, -1), o.contiguous(), proj.weight).view(x.shape)
    return x + proj(o.view(b, q_len, -1))


def _mlp_of(fused: "_Fused", i: int, x: torch.Tensor, graphs) -> torch.Tensor:
    """``x + mlp(rms_norm(x))`` of layer ``i``."""
    layer = fused.layers[i]
    if graphs is not None:
        y, _, _ = graphs[2](x.reshape(-1, x.shape[-1]), layer.post_attention_layernorm.weight, fused.gate_up[i].weight,
                            layer.mlp.down_proj.weight)
        return y.view(x.shape)
    gu = fused.gate_up[i](_rms_norm(layer.post_attention_layernorm, x))
    return x + layer.mlp.down_proj(F.silu(gu[..., :fused.inter]) * gu[..., fused.inter:])


def _time_layer(fused: "_Fused", tokens: int, compiled: bool, repeats: int = 3) -> float:
    """Seconds (best of ``repeats``, after a warm-up) of every layer's work outside attention
    for one row of ``tokens`` tokens, through the compiled graphs or the eager ops."""
    import time

    hidden, d = fused.qkv[0].weight.shape[1], fused.layers[0].self_attn.head_dim
    dtype = fused.qkv[0].weight.dtype
    x, o = torch.randn(1, tokens, hidden, dtype=dtype), torch.randn(1, fused.splits[0] // d, tokens, d, dtype=dtype)
    cos, sin = torch.randn(1, 1, tokens, d, dtype=dtype), torch.randn(1, 1, tokens, d, dtype=dtype)
    graphs = _graphs(fused, tokens) if compiled else None

    def run():
        for i in range(len(fused.layers)):
            _attention_in_of(fused, i, x, cos, sin, graphs)
            _mlp_of(fused, i, _attention_out_of(fused, i, x, o, graphs), graphs)

    times = []
    with torch.no_grad():
        run()
        for _ in range(repeats):
            t = time.perf_counter()
            run()
            times.append(time.perf_counter() - t)
    return min(times)


class _Fused:
    """The fused input projections of every decoder layer of one model."""

    def __init__(self, model):
        self.layers = list(model.model.layers)
        self._build()

    @staticmethod
    def _projections(layer) -> tuple[torch.nn.Module, ...]:
        a, m = layer.self_attn, layer.mlp
        return a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj

    def _build(self) -> None:
        self.qkv, self.gate_up, self._watch = [], [], []
        with torch.inference_mode(False), torch.no_grad():  # ordinary tensors, whatever mode the first pass ran in
            for layer in self.layers:
                mods = self._projections(layer)
                q, k, v, g, u = (m.weight.detach() for m in mods)
                self.qkv.append(_linear(torch.cat([q, k, v])))
                self.gate_up.append(_linear(torch.cat([g, u])))
                self._watch += [(m._parameters, m.weight, _stamp(m.weight)) for m in mods]
                self.splits, self.inter = (q.shape[0], k.shape[0], v.shape[0]), g.shape[0]
        kernels.pack_linears(torch.nn.ModuleList(self.qkv + self.gate_up))

    def current(self) -> "_Fused":
        """Itself, re-made first if a source weight was replaced or changed in place since it
        was built (a dict lookup and two integers per weight: cheap enough for every pass)."""
        for params, w, stamp in self._watch:
            if params["weight"] is not w or _stamp(w) != stamp:
                self._build()
                break
        return self


def _stamp(w: torch.Tensor) -> tuple[int, int]:
    """The weight's storage and in-place version (an inference tensor has none: it cannot change)."""
    try:
        return w.data_ptr(), w._version
    except RuntimeError:
        return w.data_ptr(), -1


def _linear(weight: torch.Tensor) -> torch.nn.Linear:
    m = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    m.weight = torch.nn.Parameter(weight.contiguous(), requires_grad=False)
    return m


def _rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm`` module ``norm`` on ``x``, op for op (:func:`_rms`)."""
    return _rms(x, norm.weight, norm.variance_epsilon)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Timer:
    """CPU seconds of :func:`forward`'s parts, summed over its calls while :func:`timing` is
    active (``bench/bench_llamacpp.py``'s breakdown of a decoding step)."""

    #: the parts, keys of :attr:`seconds`
    PARTS = ("attention kernel", "attention projections + RoPE", "MLP", "output layer", "rest")

    def __init__(self, clock):
        self.clock = clock
        self.seconds = dict.fromkeys(self.PARTS, 0.0)
        self.calls = 0
        self._last = 0.0

    def start(self) -> None:
        self._last = self.clock()

    def lap(self, part: str) -> None:
        now = self.clock()
        self.seconds[part] += now - self._last
        self._last = now


_TIMER: Timer | None = None


class timing:
    """``with timing(time.process_time) as t:`` times every :func:`forward` call inside by part
    (:class:`Timer`); the timing itself costs a clock read per part and layer."""

    def __init__(self, clock):
        self.timer = Timer(clock)

    def __enter__(self) -> Timer:
        global _TIMER
        _TIMER = self.timer
        return self.timer

    def __exit__(self, *exc) -> None:
        global _TIMER
        _TIMER = None


def forward(model, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None, cache,
            logits_to_keep: int = 1, output_hidden_states: bool | int | list[int] | None = None
            ) -> tuple[torch.Tensor, tuple | None]:
    """``model``'s logits for one pass on the runner's cache.

    Args:
        model: a model for which :func:`supports` holds, in eval mode.
        input_ids: ``(b, Q)`` int64.
        position_ids: ``(b, Q)`` int64, each token's position.
        mask: the runner's additive ``(b, 1, Q, kv_len)`` mask, or ``None`` for an ordinary
            causal pass from position 0 (SDPA's causal kernel).
        cache: the runner's :class:`~pipeline.engine.cache.SlotCache`, its step declared.
        logits_to_keep: the trailing positions whose logits are returned (0: all).
        output_hidden_states: as transformers takes it: ``True`` (all), an index or a list of
            indices (negative ones count from the end) into the ``L + 1`` hidden states
            (0: the embeddings, ``i``: after decoder layer ``i``, the last after the final norm).

    Returns:
        ``(logits, hidden_states)``: ``(b, logits_to_keep or Q, V)`` logits in the model's
        dtype; ``None``, or a tuple of ``L + 1`` ``(b, Q, H)`` tensors, ``None`` where not
        selected (transformers' ``hidden_states``).
    """
    timer = _TIMER
    if timer is not None:
        timer.calls += 1
        timer.start()
    fused = _FUSED.get(model)
    if fused is None:
        fused = _FUSED[model] = _Fused(model)
    fused = fused.current()
    base = model.model
    x = base.embed_tokens(input_ids)
    cos, sin = base.rotary_emb(x, position_ids=position_ids)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    b, q_len = input_ids.shape
    attn = fused.layers[0].self_attn
    d, scale = attn.head_dim, attn.scaling
    causal = mask is None and q_len > 1
    n_layers = len(fused.layers)
    keep = _selected(output_hidden_states, n_layers + 1)
    states = None if keep is None else [x if 0 in keep else None]
    folded_mask = None  # the mask for the folded query heads: made at the first layer (every layer's keys are as long)
    graphs = _compiled(fused, b * q_len)
    if timer is not None:
        timer.lap("rest")
    for i, layer in enumerate(fused.layers):
        q, k, v = _attention_in_of(fused, i, x, cos, sin, graphs)
        keys, values = cache.update(k, v, i)
        if timer is not None:
            timer.lap("attention projections + RoPE")
        group = q.shape[1] // keys.shape[1]
        if causal:
            o = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=group > 1)
        elif group == 1 or not 1 < q_len <= FOLD_MAX_QUERY:
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=None if mask is None else mask[..., : keys.shape[2]],
                                               scale=scale, enable_gqa=group > 1)
        else:
            # A verification pass: each key/value head's ``group`` query heads folded into the query
            # length, one kernel call per key/value head (see FOLD_MAX_QUERY).  Query row ``g * Q + i``
            # is head ``g``'s token ``i``: the mask is tiled ``group`` times along the query axis.
            if folded_mask is None:  # a pass of 2+ tokens without a mask took the causal kernel above
                folded_mask = mask[..., : keys.shape[2]].repeat(1, 1, group, 1)
            o = F.scaled_dot_product_attention(q.reshape(b, -1, group * q_len, d), keys, values,
                                               attn_mask=folded_mask, scale=scale).view(b, -1, q_len, d)
        if timer is not None:
            timer.lap("attention kernel")
        x = _attention_out_of(fused, i, x, o, graphs)
        if timer is not None:
            timer.lap("attention projections + RoPE")
        x = _mlp_of(fused, i, x, graphs)
        if timer is not None:
            timer.lap("MLP")
        if states is not None:
            states.append(x if i + 1 in keep else None)
    if states is not None and n_layers in keep:  # the last hidden state is the final norm's output
        states[-1] = _rms_norm(base.norm, x)
    if logits_to_keep:
        x = x[:, -logits_to_keep:]
    x = _rms_norm(base.norm, x)
    if timer is not None:
        timer.lap("rest")
    logits = model.lm_head(x)
    if timer is not None:
        timer.lap("output layer")
    return logits, None if states is None else tuple(states)


def _selected(output_hidden_states, count: int) -> set[int] | None:
    """The hidden-state indices ``output_hidden_states`` selects out of ``count`` (None: none)."""
    if output_hidden_states is None or output_hidden_states is False:
        return None
    if output_hidden_states is True:
        return set(range(count))
    picks = [output_hidden_states] if isinstance(output_hidden_states, int) else list(output_hidden_states)
    return {i % count for i in picks if -count <= i < count}
