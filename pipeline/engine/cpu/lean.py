"""The lean pass: a ``LlamaForCausalLM``'s forward on the runner's cache, without transformers'
per-module Python and with fused projections.

Why.  Around the arithmetic of a decoding step, transformers' eager model code runs per layer
seven ``nn.Linear`` calls, two RMSNorm modules, the attention-function dispatch, keyword
plumbing and decorators: a few milliseconds of Python per step of a small model.

What.  Per decoder layer::

    h = rms_norm(x);  q, k, v = split(h @ W_qkv^T);  q, k = rope(q, k)
    k, v = cache.update(k, v, layer)          # the SlotCache, exactly as the model would
    x = x + o_proj(sdpa(q, k, v, mask))        # grouped-query heads folded in a verification pass
    h = rms_norm(x);  g, u = split(h @ W_gate_up^T);  x = x + down_proj(silu(g) * u)

then the final norm and the output layer over the kept positions only.  ``W_qkv`` and
``W_gate_up`` are the model's own weights concatenated once (made again if a weight is replaced
or changed in place), run through the linear kernels of :mod:`.linear` like every other layer.
RMSNorm, RoPE (the model's own rotary module, so every RoPE type it supports), the mask and the
cache are the model's: the output equals the model's forward up to floating-point summation
order (float64: within 1e-12).  Passes of 1 to :data:`COMPILED_MAX_TOKENS` tokens in all run each
layer outside attention through :mod:`.layer`'s compiled graphs where measured faster at load.

Memory: a copy of the attention and MLP input projections (about half of a Llama's linear
weights) besides the model's weights.  The parts a pass runs are module functions
(:func:`attention_in_of`, :func:`attend`, :func:`attention_out_of`, :func:`mlp_of`,
:func:`output_layer`), which ``bench/bench_llamacpp.py`` wraps to time a step by part.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from . import layer as compiled
from . import payoff, smallm
from .compiling import INDUCTOR_MIN_ELEMENTS
from .linear import prepare_linears, weight_version
from .measure import MARGIN, Costs, best_of
from .options import CpuOptions

#: the model classes this pass implements (their forward is the reference)
SUPPORTED_CLASSES = ("LlamaForCausalLM",)
#: Passes of 2 to this many query tokens per row (verification passes) fold each key/value
#: head's query heads into the query length for SDPA instead of its grouped-query kernel
#: (``enable_gqa``), which costs up to twice as much from two query tokens on.
FOLD_MAX_QUERY = 16
#: the most tokens in all a pass may have to run the compiled layer (each count's graphs are
#: compiled, and kept where measured faster at load).  On the 2-core AVX2 machine of issue 54 a
#: one-row pass over 3 / 4 tokens measured 0.73x / 0.82x of the eager layer's, but their six
#: graphs cost a first run minutes of compiling that its rows do not repay (a first run must
#: compile only what pays: docs/benchmarks.md, "The roofline of a pass"), so the default stays at
#: 2 until the compiling is amortised; tests and benches may raise it.
COMPILED_MAX_TOKENS = 2


def supports(model) -> bool:
    """Whether :class:`LeanPass` computes ``model``'s forward: a ``LlamaForCausalLM`` with SDPA
    attention, full attention in every layer, SiLU, no projection biases, no tensor-parallel
    slicing, on the CPU in float32, bfloat16 or float64."""
    if type(model).__name__ not in SUPPORTED_CLASSES:
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


def _linear(weight: torch.Tensor) -> torch.nn.Linear:
    m = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    m.weight = torch.nn.Parameter(weight.contiguous(), requires_grad=False)
    return m


def _stamp(m: torch.nn.Module) -> tuple:
    return m.weight, weight_version(m.weight)


class LeanPass:
    """The lean forward of one model (see the module docstring), built when the model is
    prepared: its fused projections, their kernels, and the compiled layer graphs by token
    count (:attr:`graphs`; a count not there runs the eager layer: not offered, not paying for
    its compiling over ``options.expected_tokens`` (:attr:`compiling`), or not faster).

    Args:
        model: a model for which :func:`supports` holds.
        options: which parts are on (``compiled_layer``; the linear kernels' parts) and the
            tokens the model is expected to decode.
        kernels: the plan's ``shape -> ShapeKernels``, which the fused projections join.
        costs: compile and measure seconds are added here.
        ledger: the node's record of compiled graphs (:class:`.payoff.Ledger`; ``None``: none).
        rows_in_flight: the most rows its engine decodes at once (``None``: unknown).
    """

    def __init__(self, model, options: CpuOptions, kernels: dict, costs: Costs | None = None,
                 ledger: payoff.Ledger | None = None, rows_in_flight: int | None = None):
        base = model.model
        self.embed, self.rotary, self.norm, self.lm_head = base.embed_tokens, base.rotary_emb, base.norm, model.lm_head
        self.layers = list(base.layers)
        attn = self.layers[0].self_attn
        self.head_dim, self.scale = attn.head_dim, attn.scaling
        self.eps = float(self.layers[0].input_layernorm.variance_epsilon)
        self.modules = list(model.modules())[1:]  # not the model itself: the plan must not keep it alive
        self.options, self.kernels = options, kernels
        #: the small-M library whose attention kernel serves short query blocks (:func:`attend`), or None:
        #: float32, one torch thread (the kernel runs on one; SDPA would use the others)
        self.attention_kernel = (smallm.library_for(options, costs)
                                 if model.lm_head.weight.dtype == torch.float32 and torch.get_num_threads() == 1
                                 else None)
        self._build(costs, measure=True)
        self.graphs: dict[int, tuple] = {}
        #: whether the compiled layer of each token count was compiled, and why (:mod:`.payoff`)
        self.compiling: list[payoff.Decision] = []
        #: seconds spent compiling (or loading) the layer's graphs
        self.layer_compile_s = 0.0
        if options.part_on("compiled_layer") and self._offers_compiled_layer():
            ledger = ledger if ledger is not None else payoff.Ledger(None)
            for tokens in range(1, COMPILED_MAX_TOKENS + 1):
                self._compile_layer(tokens, options.expected_tokens, ledger, rows_in_flight, costs or Costs())

    def _compile_layer(self, tokens: int, expected_tokens: int | None, ledger: payoff.Ledger,
                       rows_in_flight: int | None, costs: Costs) -> None:
        """Compile the layer for passes of ``tokens`` tokens where it pays (:func:`.payoff.decide`,
        from the eager layer's time measured here), and keep it where measured faster by
        :data:`.measure.MARGIN`; its compile seconds and measured ratio go to the ``ledger``."""
        w = self.qkv[0].weight
        key = payoff.graph_key("layer", tokens, w.shape[1], self.splits, self.inter, self.head_dim, w.dtype)
        eager = self._time(tokens, None, costs)
        decision = payoff.decide(f"compiled layer, {tokens} token{'s' if tokens > 1 else ''}", graphs=3,
                                 expected_tokens=expected_tokens, compile_s=ledger.cost(key, 3),
                                 token_saving_s=eager / tokens * (1 - ledger.ratio(key, "compiled_layer")),
                                 cached=ledger.cached(key), share=payoff.served_share(tokens, rows_in_flight))
        self.compiling.append(decision)
        if not decision.pays:
            return
        before = costs.compile_s
        graphs = compiled.compile_layer(tokens=tokens, hidden=w.shape[1], splits=self.splits, inter=self.inter,
                                        head_dim=self.head_dim, eps=self.eps, dtype=w.dtype, costs=costs)
        self.layer_compile_s += costs.compile_s - before
        if graphs is None:
            return
        ratio = self._time(tokens, graphs, costs) / max(eager, 1e-9)
        ledger.record(key, 3, costs.compile_s - before, ratio)
        if ratio < MARGIN:
            self.graphs[tokens] = graphs

    def _offers_compiled_layer(self) -> bool:
        """Whether the compiled layer may pay: float32 weights of :data:`INDUCTOR_MIN_ELEMENTS` or
        more (streamed from memory), every weight it reads contiguous, as its kernels take them."""
        w = self.qkv[0].weight
        return (w.dtype == torch.float32 and w.numel() >= INDUCTOR_MIN_ELEMENTS
                and all(m.weight.is_contiguous() for layer in self.layers for m in (layer.self_attn.o_proj, layer.mlp.down_proj)))

    @staticmethod
    def _projections(layer) -> tuple[torch.nn.Module, ...]:
        a, m = layer.self_attn, layer.mlp
        return a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj

    def _build(self, costs: Costs | None = None, measure: bool = False) -> None:
        self.qkv, self.gate_up, self._watch = [], [], []
        with torch.inference_mode(False), torch.no_grad():  # ordinary tensors, whatever mode the caller is in
            for layer in self.layers:
                mods = self._projections(layer)
                q, k, v, g, u = (m.weight.detach() for m in mods)
                self.qkv.append(_linear(torch.cat([q, k, v])))
                self.gate_up.append(_linear(torch.cat([g, u])))
                self._watch += [(m._parameters, *_stamp(m)) for m in mods]
                self.splits, self.inter = (q.shape[0], k.shape[0], v.shape[0]), g.shape[0]
        self.kernels.update(prepare_linears(self.qkv + self.gate_up, self.options, self.kernels, costs, measure))

    def current(self) -> "LeanPass":
        """Itself, its fused projections made again first if a source weight was replaced or
        changed in place since (with the kernels measured at load: nothing is measured or
        compiled here)."""
        for params, w, stamp in self._watch:
            if params["weight"] is not w or weight_version(w) != stamp:
                self._build()
                break
        return self

    def has_hooks(self, model) -> bool:
        """Whether ``model`` or one of its modules has forward hooks, global ones included, other
        than transformers' own (its output-capturing hooks record only while a call of the
        model's own forward asks for them): this pass would not call them."""
        from torch.nn.modules import module as nn_module

        sets = [nn_module._global_forward_hooks, nn_module._global_forward_pre_hooks,
                model._forward_hooks, model._forward_pre_hooks]
        sets += [hooks for m in self.modules for hooks in (m._forward_hooks, m._forward_pre_hooks) if hooks]
        return any(not getattr(h, "__module__", "").startswith("transformers.") for hooks in sets for h in hooks.values())

    def _time(self, tokens: int, graphs, costs: Costs | None) -> float:
        """CPU seconds (:func:`.measure.best_of` on the CPU clock) of every layer's work outside
        attention for one row of ``tokens`` tokens, through ``graphs`` or the eager ops (``None``)."""
        dtype, hidden, d = self.qkv[0].weight.dtype, self.qkv[0].weight.shape[1], self.head_dim
        x, o = torch.randn(1, tokens, hidden, dtype=dtype), torch.randn(1, self.splits[0] // d, tokens, d, dtype=dtype)
        cos, sin = torch.randn(1, 1, tokens, d, dtype=dtype), torch.randn(1, 1, tokens, d, dtype=dtype)

        def run():
            for i in range(len(self.layers)):
                attention_in_of(self, i, x, cos, sin, graphs)
                mlp_of(self, i, attention_out_of(self, i, x, o, graphs), graphs)

        with torch.no_grad():
            return best_of(run, costs=costs, clock=time.process_time)

    def __call__(self, model, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None, cache,
                 logits_to_keep: int = 1, output_hidden_states: bool | int | list[int] | None = None
                 ) -> tuple[torch.Tensor, tuple | None]:
        """``model``'s logits for one pass on the runner's cache.

        Args:
            model: the model this pass was built for, in eval mode.
            input_ids: ``(b, Q)`` int64.
            position_ids: ``(b, Q)`` int64, each token's position.
            mask: the runner's additive ``(b, 1, Q, kv_len)`` mask, or ``None`` for an ordinary
                causal pass from position 0 (SDPA's causal kernel).
            cache: the runner's :class:`~pipeline.engine.cache.SlotCache`, its step declared.
            logits_to_keep: the trailing positions whose logits are returned (0: all).
            output_hidden_states: as transformers takes it: ``True`` (all), an index or a list
                of indices (negative ones count from the end) into the ``L + 1`` hidden states
                (0: the embeddings, ``i``: after decoder layer ``i``, the last after the final norm).

        Returns:
            ``(logits, hidden_states)``: ``(b, logits_to_keep or Q, V)`` logits in the model's
            dtype; ``None``, or a tuple of ``L + 1`` ``(b, Q, H)`` tensors, ``None`` where not
            selected (transformers' ``hidden_states``).
        """
        self.current()
        x = self.embed(input_ids)
        cos, sin = self.rotary(x, position_ids=position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        b, q_len = input_ids.shape
        n_layers = len(self.layers)
        keep = _selected(output_hidden_states, n_layers + 1)
        states = None if keep is None else [x if 0 in keep else None]
        graphs = self.graphs.get(b * q_len)
        folded = [None]  # the mask of folded query heads, made at the first layer that needs it
        for i in range(n_layers):
            q, k, v = attention_in_of(self, i, x, cos, sin, graphs)
            o = attend(self, i, q, k, v, cache, mask, folded)
            x = mlp_of(self, i, attention_out_of(self, i, x, o, graphs), graphs)
            if states is not None:
                states.append(x if i + 1 in keep else None)
        if states is not None and n_layers in keep:  # the last hidden state is the final norm's output
            states[-1] = _rms_norm(self.norm, x)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        return output_layer(self, _rms_norm(self.norm, x)), None if states is None else tuple(states)


def _rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm`` module ``norm`` on ``x``, op for op (:func:`.layer.rms`)."""
    return compiled.rms(x, norm.weight, norm.variance_epsilon)


def attention_in_of(lean: LeanPass, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, graphs
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer ``i``'s ``(b, heads, Q, d)`` queries, keys and values of the ``(b, Q, H)`` ``x``
    (input norm, QKV, RoPE): through the compiled ``graphs``, or the eager ops (``None``)."""
    layer = lean.layers[i]
    b, q_len = x.shape[:2]
    nq, nk, _ = lean.splits
    d = lean.head_dim
    if graphs is not None:
        n = b * q_len
        q, k, v, _ = graphs[0](x.reshape(n, -1), layer.input_layernorm.weight, lean.qkv[i].weight,
                               cos.reshape(n, d).contiguous(), sin.reshape(n, d).contiguous())
        return tuple(t.reshape(b, q_len, -1, d).transpose(1, 2) for t in (q, k, v))
    qkv = lean.qkv[i](_rms_norm(layer.input_layernorm, x))
    qk = qkv[..., :nq + nk].view(b, q_len, -1, d).transpose(1, 2)  # the query heads, then the key heads
    qk = qk * cos + compiled.rotate_half(qk) * sin  # RoPE on both at once
    return qk[:, : nq // d], qk[:, nq // d:], qkv[..., nq + nk:].view(b, q_len, -1, d).transpose(1, 2)


def attend(lean: LeanPass, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache, mask, folded: list
           ) -> torch.Tensor:
    """Layer ``i``'s keys and values written to the cache, and its ``(b, heads, Q, d)`` attention
    output.  A masked pass (or a one-token one) whose shapes the small-M library serves
    (:meth:`.smallm.Library.serves_attention`: float32, up to 64 query vectors per row and KV head)
    runs its attention kernel, which reads each row's keys and values once.  Otherwise a
    verification pass folds each key/value head's query heads into the query length
    (:data:`FOLD_MAX_QUERY`): query row ``g * Q + j`` is head ``g``'s token ``j``, and the mask is
    tiled along the query axis (once per pass: ``folded[0]``)."""
    keys, values = cache.update(k, v, i)
    b, _, q_len, d = q.shape
    group = q.shape[1] // keys.shape[1]
    kernel = lean.attention_kernel
    if (kernel is not None and (mask is not None or q_len == 1)
            and kernel.serves_attention(q, keys, mask) and values.stride(3) == 1):
        return kernel.attention(q, keys, values, mask, lean.scale, checked=True)  # values: the cache's, shaped as keys
    if mask is None and q_len > 1:
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=lean.scale, enable_gqa=group > 1)

    if group == 1 or not 1 < q_len <= FOLD_MAX_QUERY:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=None if mask is None else mask[..., : keys.shape[2]],
                                              scale=lean.scale, enable_gqa=group > 1)
    if folded[0] is None:
        folded[0] = mask[..., : keys.shape[2]].repeat(1, 1, group, 1)
    return F.scaled_dot_product_attention(q.reshape(b, -1, group * q_len, d), keys, values, attn_mask=folded[0],
                                          scale=lean.scale).view(b, -1, q_len, d)


def attention_out_of(lean: LeanPass, i: int, x: torch.Tensor, o: torch.Tensor, graphs) -> torch.Tensor:
    """``x + o_proj(o)`` of layer ``i``, for the ``(b, heads, Q, d)`` attention output ``o``."""
    proj = lean.layers[i].self_attn.o_proj
    b, q_len = x.shape[:2]
    o = o.transpose(1, 2).reshape(b * q_len, -1)
    if graphs is not None:
        return graphs[1](x.reshape(b * q_len, -1), o.contiguous(), proj.weight).view(x.shape)
    return x + proj(o.view(b, q_len, -1))


def mlp_of(lean: LeanPass, i: int, x: torch.Tensor, graphs) -> torch.Tensor:
    """``x + mlp(rms_norm(x))`` of layer ``i``."""
    layer = lean.layers[i]
    if graphs is not None:
        y, _, _ = graphs[2](x.reshape(-1, x.shape[-1]), layer.post_attention_layernorm.weight, lean.gate_up[i].weight,
                            layer.mlp.down_proj.weight)
        return y.view(x.shape)
    gu = lean.gate_up[i](_rms_norm(layer.post_attention_layernorm, x))
    return x + layer.mlp.down_proj(F.silu(gu[..., :lean.inter]) * gu[..., lean.inter:])


def output_layer(lean: LeanPass, x: torch.Tensor) -> torch.Tensor:
    """The logits of the final norm's output ``x`` (``lm_head``)."""
    return lean.lm_head(x)


def _selected(output_hidden_states, count: int) -> set[int] | None:
    """The hidden-state indices ``output_hidden_states`` selects out of ``count`` (None: none)."""
    if output_hidden_states is None or output_hidden_states is False:
        return None
    if output_hidden_states is True:
        return set(range(count))
    picks = [output_hidden_states] if isinstance(output_hidden_states, int) else list(output_hidden_states)
    return {i % count for i in picks if -count <= i < count}
