"""Self-speculative early exit (LayerSkip): the target's first ``L`` layers draft.

Elhoushi et al. 2024, "LayerSkip" (arXiv 2404.16710); transformers'
``assistant_early_exit``.  The draft is the target itself cut after layer ``L``: the
first ``L`` decoder layers, then the model's own final norm and LM head.  A checkpoint
trained with an early-exit loss (e.g. ``facebook/layerskip-llama3.2-1B``) drafts well;
any other model drafts poorly but stays lossless.

KV reuse.  Draft and verifier share one KV cache, the target's own (the loop hands it to
:meth:`EarlyExitProposer.reset`).  The draft runs layers ``0 .. L-1`` on the committed
token and the draft tokens, writing their keys and values into the target's cache for
those layers, and keeps the layer-``L`` hidden states it computed.  The verification pass
(:meth:`EarlyExitProposer.target_forward`, which the loop calls instead of the plain
forward) then runs the first ``L`` layers only on the positions the draft did not run
(the last draft token) and the layers ``L .. N-1`` on every position, starting from the
kept hidden states: the first ``L`` layers are never recomputed for a drafted position.
After verification every layer holds the same positions again; the loop crops them all to
the committed length and the rejected positions' shallow KV goes with them.

Lossless: the verification logits are those of the full model on the same tokens (the
first ``L`` layers computed incrementally instead of in one batch, as any KV-cached
decoding does).

Supported targets: decoder-only models whose forward is exactly ``embed_tokens`` ->
``layers`` -> ``norm`` -> ``lm_head`` (model types in :data:`SUPPORTED_MODEL_TYPES`:
Llama, Mistral, Qwen2, Qwen3), with eager, SDPA or flash attention and full (not
sliding-window) attention in every layer.  Others are refused when the engine is built.
"""

from __future__ import annotations

import torch

from .base import DraftRequest
from .draft_model import DraftModelProposer, text_config

_ATTENTION = ("eager", "sdpa", "flash_attention_2", "flash_attention_3")
#: model types whose forward is exactly embed_tokens -> layers -> norm -> lm_head (no embedding
#: scale as in Gemma, no extra inputs): splitting them by hand reproduces the full model
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def early_exit_parts(target, layers: int):
    """The modules early exit runs, checked; raises ``ValueError`` naming ``assistant_early_exit``."""
    config = text_config(target)
    total = getattr(config, "num_hidden_layers", None)
    if total is None or not (1 <= layers <= total - 1):
        raise ValueError(
            f"assistant_early_exit={layers} is out of range: the target has {total} layers, "
            f"so the draft may use 1 .. {None if total is None else total - 1} of them"
        )
    base = getattr(target, getattr(target, "base_model_prefix", "model"), None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if (
        getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES
        or base is None
        or not all(hasattr(base, n) for n in needed)
        or target.get_output_embeddings() is None
    ):
        raise ValueError(
            f"method 'early_exit' supports Llama-like decoders ({', '.join(SUPPORTED_MODEL_TYPES)}); "
            f"the target is {type(target).__name__} (model_type {getattr(config, 'model_type', None)!r})"
        )
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in _ATTENTION:
        raise ValueError(f"method 'early_exit' supports attention {_ATTENTION}, the target uses {impl!r}")
    if any(t not in (None, "full_attention") for t in (getattr(config, "layer_types", None) or [])):
        raise ValueError("method 'early_exit' needs full attention in every layer (no sliding windows)")
    return base


class _Logits:
    def __init__(self, logits):
        self.logits = logits


class _LayerSplit:
    """The target run in two parts on its own cache: layers ``0..L-1`` (shallow) and
    ``L..N-1`` (deep).  Keeps the layer-``L`` hidden states of positions the shallow part
    ran and the deep part did not yet (``pending``)."""

    def __init__(self, target, layers: int):
        self.target = target
        self.base = early_exit_parts(target, layers)
        self.config = target.config
        self.device = target.device
        self.L = layers
        self.head = target.get_output_embeddings()
        self.flash = "flash" in (getattr(text_config(target), "_attn_implementation", None) or "")
        self.cache = None
        self.pending: torch.Tensor | None = None  # (1, low - high, H)
        self.pending_ids: torch.Tensor | None = None  # (1, low - high)

    # lengths read from the cache itself, so they cannot drift from it
    @property
    def low(self) -> int:
        return self.cache.get_seq_length(0)

    @property
    def high(self) -> int:
        return self.cache.get_seq_length(self.L)

    def reset(self, cache) -> None:
        self.cache = cache
        self.pending = self.pending_ids = None

    def _layers(self, hidden: torch.Tensor, start: int, layers) -> torch.Tensor:
        n = hidden.shape[1]
        position_ids = torch.arange(start, start + n, device=hidden.device).view(1, -1)
        position_embeddings = self.base.rotary_emb(hidden, position_ids=position_ids)
        mask = None
        if n > 1 and not self.flash:  # flash attention aligns its causal mask bottom-right itself
            q = torch.arange(start, start + n, device=hidden.device).view(-1, 1)
            k = torch.arange(start + n, device=hidden.device).view(1, -1)
            mask = torch.zeros(n, start + n, dtype=hidden.dtype, device=hidden.device)
            mask.masked_fill_(k > q, torch.finfo(hidden.dtype).min)
            mask = mask.view(1, 1, n, start + n)
        for layer in layers:
            hidden = layer(
                hidden, attention_mask=mask, position_ids=position_ids, cache=self.cache, use_cache=True,
                position_embeddings=position_embeddings,
            )
        return hidden

    def shallow(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Layers ``0..L-1`` on ``input_ids`` (the positions after ``low``); keeps the output."""
        hidden = self._layers(self.base.embed_tokens(input_ids), self.low, self.base.layers[: self.L])
        if self.pending is None:
            self.pending, self.pending_ids = hidden, input_ids
        else:
            self.pending = torch.cat([self.pending, hidden], dim=1)
            self.pending_ids = torch.cat([self.pending_ids, input_ids], dim=1)
        return hidden

    def crop_shallow(self, length: int) -> None:
        for layer in self.cache.layers[: self.L]:
            extra = layer.get_seq_length() - length
            if extra > 0:
                layer.crop(-extra)
        if self.pending is not None:
            keep = max(0, length - self.high)
            self.pending, self.pending_ids = self.pending[:, :keep], self.pending_ids[:, :keep]
            if keep == 0:
                self.pending = self.pending_ids = None

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.base.norm(hidden))

    # --- the draft model's interface, as DraftModelProposer calls it
    def __call__(self, input_ids, cache=None, use_cache=True, logits_to_keep=1):
        hidden = self.shallow(input_ids)
        return _Logits(self.head_logits(hidden[:, -logits_to_keep:]))

    # --- the verification pass
    def full(self, input_ids: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
        high, m = self.high, input_ids.shape[1]
        done = self.low - high  # leading positions whose shallow layers already ran
        if done > m or (done > 0 and not torch.equal(self.pending_ids, input_ids[:, :done])):
            self.crop_shallow(high)  # not what the draft ran: recompute (never happens in the loop)
            done = 0
        if done < m:
            self.shallow(input_ids[:, done:])
        hidden = self.pending
        self.pending = self.pending_ids = None
        hidden = self._layers(hidden, high, self.base.layers[self.L :])
        return self.head_logits(hidden[:, -logits_to_keep:])[0]


class EarlyExitProposer(DraftModelProposer):
    """Drafts with the target's first ``layers`` layers, sharing its KV cache.

    The drafting loop (greedy / sampled tokens, ``q`` for sampling and ensemble
    verification, the confidence threshold) is :class:`DraftModelProposer`'s; the "draft
    model" it calls is the shallow part of the target.

    Args:
        target: the target model (Llama-like, see the module docstring).
        layers: ``L`` in ``1 .. num_hidden_layers - 1``.
        confidence_threshold: as for the draft model.

    Raises:
        ValueError: ``layers`` out of range (naming ``assistant_early_exit``) or a target
            this proposer cannot split.
    """

    def __init__(self, target, layers: int, confidence_threshold: float = 0.0):
        self.split = _LayerSplit(target, layers)
        super().__init__(self.split, text_config(target).vocab_size, confidence_threshold)

    def reset(self, target_cache=None) -> None:
        if target_cache is None:
            raise ValueError("early exit drafts into the target's KV cache: reset() needs it")
        self.split.reset(target_cache)
        self.cache = target_cache
        self.seen = 0

    def propose(self, request: DraftRequest):
        self.seen = self.split.low
        return super().propose(request)

    def rollback(self, valid_length: int) -> None:
        # The loop has cropped every layer of the shared cache; drop anything beyond it.
        self.split.crop_shallow(valid_length)
        self.seen = self.split.low

    def target_forward(self, target, input_ids, cache, logits_to_keep: int) -> torch.Tensor:
        if cache is not self.split.cache:
            raise ValueError("early exit verifies on the cache it was reset with")
        return self.split.full(input_ids, logits_to_keep)
