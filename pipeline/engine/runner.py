"""Running one causal LM over the ragged rows of a batch, on a :class:`SlotCache`.

:class:`ModelRunner` turns "these rows feed these tokens at these positions" into one
forward pass of a Hugging Face model: rows are left-padded to the longest, every real
token gets its explicit ``position_ids`` and writes its cache slot, padding writes the
scratch slot, and a 4D attention mask per layer kind (full, sliding window) gives each
query exactly the positions its row may read.  Left padding puts every row's last real
token at the last index, so ``logits_to_keep`` keeps the same trailing positions of
every row.

:func:`model_layout` reads what the runner needs from a model's config, and refuses
what the engine cannot keep exact, naming the layer type and the method:

- layer kinds: ``full_attention`` and ``sliding_attention`` (window ``W``: a query at
  position ``p`` reads ``p - W < s <= p``, as transformers' sliding mask) are supported,
  mixed freely (Gemma 2 / 3, GPT-OSS, Qwen2 with ``use_sliding_window``, all-sliding
  Mistral).  Recurrent and linear-attention layers (Mamba, LFM2 convolutions, Qwen3-Next
  linear attention, hybrids) keep a state that cannot be rolled back by position, and
  chunked attention is not implemented: both are refused.
- the context: models with learned absolute positions stop at ``max_position_embeddings``;
  RoPE models at ``max_position_embeddings``, or ``factor x original_max_position_embeddings``
  when the RoPE scaling (YaRN, LongRoPE, Llama 3) names an original length and that is
  longer.
- LongRoPE (Phi-3): transformers picks the short or the long factors from the highest
  position of each forward pass, and ``generate()`` recomputes the whole cache the first
  time a row grows past ``original_max_position_embeddings``.  The runner groups rows by
  regime (so one row's length never changes another row's factors) and reports the switch
  point; the loop keeps a verification pass from straddling it and recomputes the row's
  cache when it crosses, as ``generate()`` does.  ``dynamic`` RoPE, whose frequencies
  follow every pass's longest position, is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import cpu
from .cache import SlotCache

ATTENTION_KINDS = ("full_attention", "sliding_attention")
#: architectures with a recurrent state whose configs do not name it in ``layer_types``
RECURRENT_MODEL_TYPES = {
    "mamba", "mamba2", "falcon_mamba", "rwkv", "recurrent_gemma", "xlstm", "zamba", "zamba2", "bamba",
    "jamba", "nemotron_h", "granitemoehybrid", "falcon_h1", "lfm2", "lfm2_moe", "qwen3_next", "minimax",
    "kimi_linear", "plamo2", "hunyuan_v1_moe_linear", "lfm2_vl",
}
SUPPORTED_ATTENTION = ("eager", "sdpa")


def text_config(model_or_config):
    config = getattr(model_or_config, "config", model_or_config)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _rope_parameters(config) -> list[dict]:
    """Every RoPE parameter dict of a config (nested per layer type in Gemma 3 / Olmo 3)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(rope, dict):
        return []
    if all(isinstance(v, dict) for v in rope.values()) and rope:
        return list(rope.values())
    return [rope]


@dataclass(frozen=True)
class ModelLayout:
    """What the runner needs to know of a model.

    Attributes:
        layer_types: per decoder layer, ``"full_attention"`` or ``"sliding_attention"``.
        sliding_window: ``W`` of the sliding layers (``None`` when there are none).
        context: the most positions a row may have (prompt + generated), or ``None``.
        longrope_switch: ``original_max_position_embeddings`` of a LongRoPE model: a pass
            whose highest position + 1 exceeds it uses the long factors.
        mask_mapping: the model's forward takes a dict of masks per layer kind (mixed
            layers); else one 4D mask.
    """

    layer_types: tuple[str, ...]
    sliding_window: int | None
    context: int | None
    longrope_switch: int | None
    mask_mapping: bool

    def regime(self, positions_end: int) -> int:
        """RoPE regime of a pass whose highest position + 1 is ``positions_end`` (0: the
        only one, or LongRoPE's short factors; 1: LongRoPE's long factors)."""
        return int(self.longrope_switch is not None and positions_end > self.longrope_switch)


def model_layout(model, role: str = "target", method: str = "plain") -> ModelLayout:
    """Read a model's attention layout and context; refuse what the engine cannot run.

    Args:
        model: a loaded causal LM (``PreTrainedModel``).
        role: ``"target"`` or ``"drafter"`` (named in errors).
        method: the speculation method (named in errors).

    Raises:
        ValueError: a recurrent / linear-attention / hybrid layer, an unsupported attention
            kind or implementation, or ``dynamic`` RoPE (the message names it and the method).
    """
    config = text_config(model)
    model_type = getattr(config, "model_type", None)
    n_layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None) or 0
    layer_types = getattr(config, "layer_types", None)
    bad = sorted({t for t in (layer_types or []) if t not in ATTENTION_KINDS})
    linear = False
    try:
        from transformers import DynamicCache

        linear = any(DynamicCache(config=config).is_linear)
    except Exception:  # a config DynamicCache cannot read: judged by its layer types alone
        pass
    if bad or linear or model_type in RECURRENT_MODEL_TYPES:
        kinds = ", ".join(bad) if bad else "recurrent / linear-attention"
        raise ValueError(
            f"the {role} ({type(model).__name__}, model_type {model_type!r}) has {kinds} layers, whose state "
            f"cannot be rolled back token by token; method {method!r} needs a KV cache it can roll back, so "
            f"this architecture is not supported (transformer layers with full or sliding-window attention are)"
        )
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"the {role} uses attention implementation {impl!r}; the engine passes a 4D attention mask per row "
            f"and supports {SUPPORTED_ATTENTION} (load it with attn_implementation='sdpa')"
        )
    window = getattr(config, "sliding_window", None)
    if layer_types is None:
        uses_window = window is not None and getattr(config, "use_sliding_window", True) is not False
        layer_types = ["sliding_attention" if uses_window else "full_attention"] * n_layers
    layer_types = tuple(layer_types[:n_layers] if n_layers else layer_types)
    if "sliding_attention" not in layer_types:
        window = None
    elif not isinstance(window, int) or window <= 0:
        raise ValueError(f"the {role} has sliding-window layers but sliding_window={window!r}")

    rope = _rope_parameters(config)
    types = {r.get("rope_type", r.get("type", "default")) for r in rope}
    if "dynamic" in types:
        raise ValueError(
            f"the {role} uses 'dynamic' RoPE scaling, whose frequencies follow the longest position of each "
            f"forward pass: no batched or speculative decoding can reproduce plain decoding exactly (method "
            f"{method!r}); use a static scaling (linear, yarn, longrope)"
        )
    max_pos = getattr(config, "max_position_embeddings", None)
    context = max_pos
    switch = None
    for r in rope:
        original = r.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
        factor = r.get("factor")
        kind = r.get("rope_type", r.get("type"))
        if original and factor and kind in ("yarn", "longrope", "llama3"):
            context = max(context or 0, int(factor * original))
        if kind == "longrope":
            switch = int(original or max_pos)
    return ModelLayout(layer_types, window, context, switch, len(set(layer_types)) > 1)


class ModelRunner:
    """One model, its :class:`SlotCache` and the masks of its forward passes.

    The runner chooses no kernel: a model prepared at load (:func:`pipeline.engine.cpu.prepare`)
    runs its plan's lean forward where the plan takes the pass, and its own forward (with the
    plan's attention and linear kernels) otherwise; a model never prepared runs its own forward.

    Args:
        model: a causal LM in eval mode.
        max_rows: rows in flight (slots of the cache).
        layout: the model's :class:`ModelLayout` (default: read from the model).
    """

    def __init__(self, model, max_rows: int, layout: ModelLayout | None = None):
        self.model = model
        self.layout = layout or model_layout(model)
        self.cache = SlotCache(max_rows, max_capacity=self.layout.context)
        self.device = model.device
        self.impl = getattr(text_config(model), "_attn_implementation", None) or "eager"
        self.dtype = _float_dtype(model)
        #: what pipeline.engine.cpu.prepare did to the model at load (None: its own forward, default kernels)
        self.cpu = cpu.plan_of(model)

    # ------------------------------------------------------------------ inputs
    def inputs(self, slots: list[int], tokens: list[torch.Tensor], starts: list[int], trees=None):
        """Left-padded inputs, ``position_ids``, write slots and the masks of one pass.

        Args:
            slots: the cache slot of each row.
            tokens: per row a ``(q_b,)`` int64 tensor (``q_b >= 1``) of the tokens it feeds,
                or a ``(q_b, H)`` float tensor of input embeddings.
            starts: per row the position of its first token.
            trees: per row ``None`` or a token tree over its tokens (see :meth:`forward`).

        Returns:
            ``(inputs (b, Q) or (b, Q, H), position_ids (b, Q), write (b, Q), kv_len, mask)``.
        """
        q = max(int(t.shape[0]) for t in tokens)
        b = len(tokens)
        device = self.device
        first = tokens[0]
        if first.dim() == 1:
            input_ids = torch.zeros((b, q), dtype=torch.long, device=device)
        else:
            input_ids = first.new_zeros((b, q, first.shape[-1]))
        lengths = torch.tensor([int(t.shape[0]) for t in tokens], device=device)
        start = torch.tensor(starts, dtype=torch.long, device=device)
        for i, t in enumerate(tokens):
            input_ids[i, q - t.shape[0]:] = t.to(device)
        j = torch.arange(q, device=device).view(1, -1)
        offset = j - (q - lengths).view(-1, 1)  # index within the row's real tokens (< 0: padding)
        real = offset >= 0
        position_ids = start.view(-1, 1) + offset.clamp_min(0)
        write = torch.where(real, position_ids, torch.full_like(position_ids, -1))
        kv_len = int((start + lengths).max())
        tree_rows = {}
        for i, parents in enumerate(trees or ()):
            if parents is None:
                continue
            m = int(tokens[i].shape[0])
            if len(parents) != m - 1:
                raise ValueError(f"a token tree of {len(parents)} nodes needs {len(parents) + 1} tokens, got {m}")
            depth, ancestors = tree_layout(parents, device)
            position_ids[i, q - m:] = starts[i] + depth  # a node's position is its depth; its slot its index
            tree_rows[i] = (starts[i], depth, ancestors)
        return input_ids, position_ids, write, kv_len, self.masks(position_ids, kv_len, tree_rows)

    def masks(self, position_ids: torch.Tensor, kv_len: int, trees: dict | None = None):
        """Additive 4D masks ``(b, 1, Q, kv_len)`` (0 = read, dtype min = hidden) for the
        queries at ``position_ids``: one tensor, or a dict per layer kind.

        ``trees``: for a row verifying a token tree, ``{row: (start, depth (m,), ancestors
        (m, m))}``: its ``m`` tokens (the root, then the nodes) sit in slots ``start ..
        start + m - 1`` at positions ``start + depth``, and a token reads the row's slots
        before ``start`` and those of its ancestors and itself (the tree attention mask of
        SpecInfer); in a sliding-window layer, within the window by position."""
        s = torch.arange(kv_len, device=position_ids.device).view(1, 1, -1)
        p = position_ids.unsqueeze(-1)
        kv_pos = s
        full = s <= p
        if trees:
            q = position_ids.shape[1]
            full = full.expand(position_ids.shape[0], q, kv_len).clone()
            kv_pos = s.view(1, -1).repeat(position_ids.shape[0], 1)
            for i, (start, depth, ancestors) in trees.items():
                m = depth.shape[0]
                kv_pos[i, start:start + m] = start + depth
                block = full[i, q - m:]
                block[:, start:] = False
                block[:, start:start + m] = ancestors
            kv_pos = kv_pos.unsqueeze(1)
        allowed = {"full_attention": full}
        if self.layout.sliding_window is not None:
            allowed["sliding_attention"] = full & (kv_pos > p - self.layout.sliding_window)
        low = torch.finfo(self.dtype).min
        out = {}
        for kind in set(self.layout.layer_types):
            m = torch.zeros(allowed[kind].shape, dtype=self.dtype, device=position_ids.device)
            out[kind] = m.masked_fill_(~allowed[kind], low).unsqueeze(1)
        if self.layout.mask_mapping:
            return out
        return out[self.layout.layer_types[0]] if self.layout.layer_types else out["full_attention"]

    def _plain_causal(self, tokens, starts) -> bool:
        """Whether a pass is an ordinary causal one that SDPA can mask itself (``is_causal``):
        every row feeds the same number of tokens from position 0, and no sliding window
        is shorter than them."""
        if self.impl != "sdpa" or any(starts) or len({int(t.shape[0]) for t in tokens}) != 1:
            return False
        q = int(tokens[0].shape[0])
        return q > 1 and (self.layout.sliding_window is None or q <= self.layout.sliding_window)

    # ------------------------------------------------------------------ forward
    def forward(self, slots: list[int], tokens: list[torch.Tensor], starts: list[int], logits_to_keep: int = 1,
                model=None, trees=None, **kwargs):
        """One pass of ``model`` (default: this runner's model) over the rows.

        ``tokens``: per row ``(q_b,)`` token ids or ``(q_b, H)`` input embeddings (see
        :meth:`inputs`).  Returns the model's output; ``logits`` is ``(b, logits_to_keep,
        V)``: the last ``logits_to_keep`` positions of every row (left padding aligns them).  Rows whose
        LongRoPE regimes differ run as separate passes, merged back in row order (only
        ``logits`` is merged then).

        ``trees``: per row ``None`` or the ``parents`` of a token tree
        (:class:`~pipeline.engine.proposers.base.Draft`) whose root is the row's first token
        and whose nodes are the rest: token ``i`` writes slot ``starts[b] + i`` as usual, but
        takes position ``starts[b] +`` its depth and attends to its ancestors only
        (:meth:`masks`).  Not with LongRoPE (the regime follows the slots).
        """
        model = model if model is not None else self.model
        if trees is not None and self.layout.longrope_switch is not None and any(t is not None for t in trees):
            raise ValueError("token trees are not supported with LongRoPE targets")
        regimes = [self.layout.regime(s + int(t.shape[0])) for s, t in zip(starts, tokens)]
        if len(set(regimes)) > 1:
            groups = {r: [i for i, x in enumerate(regimes) if x == r] for r in sorted(set(regimes))}
            parts = {r: self.forward([slots[i] for i in idx], [tokens[i] for i in idx], [starts[i] for i in idx],
                                     logits_to_keep, model, **kwargs).logits for r, idx in groups.items()}
            first = next(iter(parts.values()))
            logits = first.new_zeros((len(slots), logits_to_keep, first.shape[-1]))
            for r, idx in groups.items():
                m = parts[r].shape[1]  # a group shorter than logits_to_keep returns fewer positions
                logits[idx, logits_to_keep - m:] = parts[r]
            return _Output(logits)
        inputs, position_ids, write, kv_len, mask = self.inputs(slots, tokens, starts, trees)
        if self._plain_causal(tokens, starts) and not any(t is not None for t in trees or ()):
            mask = None  # every row starts at 0 with the same length: SDPA's own causal kernel
        self.cache.step(slots, write, kv_len)
        feed = {"input_ids": inputs} if inputs.dim() == 2 else {"inputs_embeds": inputs}
        plan = self.cpu if model is self.model else cpu.plan_of(model)
        try:
            lean = plan.forward_of(model, inputs, kwargs) if plan is not None else None
            if lean is not None:
                return _Output(*lean(model, inputs, position_ids, mask, self.cache, logits_to_keep, **kwargs))
            with cpu.attention_implementation(model, plan is not None and plan.small_query_attention and mask is not None):
                return model(**feed, position_ids=position_ids, attention_mask=mask, cache=self.cache,
                             use_cache=True, logits_to_keep=logits_to_keep, **kwargs)
        finally:
            self.cache.current = None


def tree_layout(parents: list[int], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The depth ``(m,)`` int64 (root 0) and the ancestor-or-self matrix ``(m, m)`` bool of a
    token tree's ``m = len(parents) + 1`` tokens (the root first, then node ``j`` at ``j + 1``;
    ``parents[j] < j``, ``-1`` for the root)."""
    m = len(parents) + 1
    depth = [0] * m
    anc = torch.zeros((m, m), dtype=torch.bool)
    anc[0, 0] = True
    for j, par in enumerate(parents):
        i, up = j + 1, par + 1
        if not -1 <= par < j:
            raise ValueError(f"a token tree's node {j} has parent {par}: parents must come before their children")
        depth[i] = depth[up] + 1
        anc[i] = anc[up]
        anc[i, i] = True
    return torch.tensor(depth, dtype=torch.long, device=device), anc.to(device)


class _Output:
    def __init__(self, logits, hidden_states=None):
        self.logits = logits
        self.hidden_states = hidden_states


def _float_dtype(model) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def length_groups(lengths: list[int], max_tokens: int = 16384) -> list[list[int]]:
    """Indices of ``lengths`` grouped for prefill passes: rows of the same length together
    (no padding, and an ordinary causal pass), at most ``max_tokens`` tokens a pass."""
    groups: dict[int, list[list[int]]] = {}
    for i, n in enumerate(lengths):
        runs = groups.setdefault(n, [[]])
        if runs[-1] and n * (len(runs[-1]) + 1) > max_tokens:
            runs.append([])
        runs[-1].append(i)
    return [g for n in sorted(groups) for g in groups[n]]


def prefill(forward, slots: list[int], prompts: list[torch.Tensor]) -> None:
    """Feed each row's ``prompt[:-1]`` (``prompts[i]`` is ``(1, P)``) from position 0
    through ``forward(slots, tokens, starts, logits_to_keep=1)``, rows of the same length
    together.  One-token prompts need nothing."""
    todo = [(s, p[0, :-1]) for s, p in zip(slots, prompts) if p.shape[1] > 1]
    for group in length_groups([int(t.shape[0]) for _, t in todo]):
        forward([todo[i][0] for i in group], [todo[i][1] for i in group], [0] * len(group), logits_to_keep=1)
