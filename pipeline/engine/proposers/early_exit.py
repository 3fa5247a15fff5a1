"""Self-speculative early exit (LayerSkip): the target's first ``L`` layers draft.

Elhoushi et al. 2024, "LayerSkip" (arXiv 2404.16710); transformers'
``assistant_early_exit``.  The draft is the target itself cut after layer ``L``: the
first ``L`` decoder layers, then the model's own final norm and LM head.  A checkpoint
trained with an early-exit loss (e.g. ``facebook/layerskip-llama3.2-1B``) drafts well;
any other model drafts poorly but stays lossless.

Two views of the target, both running the model's own ``forward`` (so its embedding
scale, per-layer-type RoPE and masks, final norm and logit soft-capping all apply):

- the *shallow* view runs layers ``0 .. L-1`` (``config.num_hidden_layers = L`` for the
  call, as transformers' early exit does), then the norm and head: the draft logits.  A
  hook keeps the hidden state each position leaves layer ``L-1`` with;
- the *deep* view runs layers ``L .. N-1`` (the decoder's layer list and ``layer_types``
  sliced for the call) from those kept hidden states as ``inputs_embeds``.

KV reuse.  Draft and verifier share one KV cache, the target's own.  Drafting writes the
first ``L`` layers' keys and values of the committed token and the draft tokens; the
verification pass (:meth:`EarlyExitProposer.target_forward`) then runs the shallow view
only on the position the draft did not run (the last draft token) and the deep view on
every position: the first ``L`` layers are never recomputed for a drafted position.  In
the slot cache (one slot per position) every layer stays aligned by construction, and a
rejected position's entries are overwritten when that position is written again.

Only for the tokens it drafted: the step may verify another source's draft (a reference,
suffix's alternatives) or cut its own, so the kept hidden states (and the first ``L``
layers' entries) of a position are reused only where the verified token there is the one
the draft ran (token ids and positions, :class:`~.base.DraftedTokens`); from the first
position where they differ, the shallow view runs again on the verified tokens, rewriting
those entries.

Lossless: the verification logits are those of the full model on the same tokens (the
first ``L`` layers computed incrementally instead of in one batch, as any KV-cached
decoding does).  When the engine is built a probe checks that shallow + deep views
reproduce the full model's logits; a model whose forward does more than embed -> layers ->
norm -> head (learned position embeddings added to the input, per-layer inputs) fails it
and is refused.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..methods import param, POSITIVE_INT
from ..runner import ModelRunner, text_config
from .base import DraftedTokens, DraftRequest
from .draft_model import ConfidenceParams, DraftModelProposer


@dataclass
class Params(ConfidenceParams):
    """Method ``early_exit``'s parameters: the exit layer, and the confidence stop of a drafter."""

    assistant_early_exit: int | None = param(
        None, "method ``early_exit`` only: the number ``L`` of the target's first layers that draft (with its "
        "final norm and LM head); must be in ``1 .. num_hidden_layers - 1`` (checked when the engine is built).",
        POSITIVE_INT, what="layers that draft", required=True)


def _decoder(target):
    base = target.get_decoder() if hasattr(target, "get_decoder") else None
    if base is None or not hasattr(base, "layers"):
        raise ValueError(
            f"method 'early_exit' needs a decoder with a list of layers; {type(target).__name__} has none"
        )
    return base


class _Views:
    """The shallow and deep views of one target (see the module docstring)."""

    def __init__(self, target, layers: int):
        config = text_config(target)
        total = getattr(config, "num_hidden_layers", None)
        if isinstance(layers, bool) or not isinstance(layers, int) or total is None or not (1 <= layers <= total - 1):
            raise ValueError(
                f"assistant_early_exit={layers!r} is out of range: the target has {total} layers, "
                f"so the draft may use 1 .. {None if total is None else total - 1} of them"
            )
        self.target = target
        self.config = config
        self.base = _decoder(target)
        self.L = layers
        self.N = total
        self.captured: torch.Tensor | None = None
        self._hook_on = False
        self.base.layers[layers - 1].register_forward_hook(self._capture)

    def _capture(self, module, args, output):
        if self._hook_on:
            self.captured = output[0] if isinstance(output, tuple) else output

    @contextlib.contextmanager
    def shallow(self):
        """Layers ``0 .. L-1``, norm, head; the layer-``L`` hidden states land in ``captured``."""
        old = self.config.num_hidden_layers
        self.config.num_hidden_layers = self.L
        self._hook_on = True
        try:
            yield
        finally:
            self._hook_on = False
            self.config.num_hidden_layers = old

    @contextlib.contextmanager
    def deep(self):
        """Layers ``L .. N-1``, norm, head, from ``inputs_embeds`` = layer-``L`` hidden states."""
        cfg, base = self.config, self.base
        old_n, old_layers = cfg.num_hidden_layers, base.layers
        old_types = getattr(cfg, "layer_types", None)
        base.layers = torch.nn.ModuleList(list(old_layers)[self.L :])
        cfg.num_hidden_layers = self.N - self.L
        if old_types is not None:
            cfg.layer_types = list(old_types)[self.L :]
        try:
            yield
        finally:
            base.layers = old_layers
            cfg.num_hidden_layers = old_n
            if old_types is not None:
                cfg.layer_types = old_types

    @torch.inference_mode()
    def probe(self, runner: ModelRunner) -> None:
        """Check that shallow + deep reproduce the full model on a random input.

        Raises:
            ValueError: they do not (the model cannot be split this way).
        """
        vocab = self.config.vocab_size
        n = 5
        tokens = [torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(0)).to(runner.device)]
        try:
            full = runner.forward([0], tokens, [0], logits_to_keep=n).logits.float()
            with self.shallow():
                runner.forward([0], tokens, [0], logits_to_keep=1)
            hidden = self.captured[0]
            with self.deep():
                split = runner.forward([0], [hidden], [0], logits_to_keep=n).logits.float()
        except Exception as e:  # noqa: BLE001 - any failure means the model cannot be split
            raise ValueError(
                f"method 'early_exit' cannot split {type(self.target).__name__} after layer {self.L}: "
                f"{type(e).__name__}: {e}"
            ) from None
        tol = 1e-2 if runner.dtype in (torch.float16, torch.bfloat16) else 1e-4
        scale = full.abs().max().clamp_min(1.0)
        if not torch.allclose(full, split, atol=float(tol * scale), rtol=0):
            raise ValueError(
                f"method 'early_exit' cannot split {type(self.target).__name__} (model_type "
                f"{getattr(self.config, 'model_type', None)!r}): running its layers in two parts does not give the "
                "full model's logits (its forward does more than embed -> layers -> norm -> head)"
            )


class EarlyExitProposer(DraftModelProposer):
    """Drafts with the target's first ``layers`` layers, sharing its KV cache.

    The drafting loop (greedy / sampled tokens, ``q`` for sampling and ensemble
    verification, the confidence threshold, rows drafting together) is
    :class:`DraftModelProposer`'s; the "draft model" it runs is the shallow view.

    Args:
        target: the target model.
        layers: ``L`` in ``1 .. num_hidden_layers - 1``.
        confidence_threshold: as for the draft model.

    Raises:
        ValueError: ``layers`` out of range (naming ``assistant_early_exit``) or a target
            whose layers cannot be split (checked by a probe when the engine binds).
    """

    def __init__(self, target, layers: int, confidence_threshold: float = 0.0):
        self.views = _Views(target, layers)
        super().__init__(target, text_config(target).vocab_size, confidence_threshold, method="early_exit")
        self.pending: list[torch.Tensor | None] = []
        self.pending_start: list[int] = []  # per slot: the position of pending[slot]'s first row
        # check now, on a throw-away runner, so a bad target fails when the engine is built
        self.views.probe(ModelRunner(target, 1, self.layout))

    def models(self) -> list[tuple[object, str]]:
        return []  # the target's own layers, which the engine prepares as the target

    def bind(self, max_rows: int, target_runner) -> None:
        self.runner = target_runner
        self.seen = [0] * max_rows
        self.pending = [None] * max_rows  # per slot: layer-L hidden states of the positions drafted
        self.pending_start = [0] * max_rows
        self.drafted = DraftedTokens(max_rows)  # per slot: the draft tokens the shallow view ran

    def admit(self, slots, prompts) -> None:
        for s, p in zip(slots, prompts):
            self.seen[s] = p.shape[1] - 1  # the target's prefill filled every layer
            self.pending[s] = None
            self.drafted.forget(s)

    def rollback(self, slot: int, valid_length: int) -> None:
        # the verification pass ran every layer on every position it fed, on the verified
        # tokens (target_forward): all layers are valid up to the committed prefix; nothing
        # pending survives
        self.seen[slot] = valid_length
        self.pending[slot] = None
        self.drafted.forget(slot)

    def reserve(self, length: int) -> None:
        pass  # the target's cache, which the engine sizes

    def _forward(self, slots, tokens, starts, logits_to_keep=1):
        with self.views.shallow():
            logits = self.runner.forward(slots, tokens, starts, logits_to_keep=logits_to_keep).logits
        hidden = self.views.captured
        for i, (s, t) in enumerate(zip(slots, tokens)):
            h = hidden[i, hidden.shape[1] - t.shape[0]:]
            if self.pending[s] is None:
                self.pending[s], self.pending_start[s] = h, starts[i]
            else:
                self.pending[s] = torch.cat([self.pending[s], h])
        return logits

    def propose(self, requests: list[DraftRequest]):
        for r in requests:
            self.pending[r.slot] = None
            self.drafted.forget(r.slot)
        return super().propose(requests)

    def _reusable(self, slot: int, tokens: torch.Tensor, start: int) -> int:
        """How many of the verified ``tokens`` (from position ``start``) have their layer-``L``
        hidden state (and first ``L`` layers' entries) from the draft: the positions the
        shallow view ran, up to the first whose token is not the verified one (the draft's
        positions before its first draft token hold committed tokens)."""
        pending = self.pending[slot]
        if pending is None or self.pending_start[slot] > start:
            return 0
        end = self.pending_start[slot] + pending.shape[0]
        agreed = self.drafted.agreed(slot, tokens, start)
        if agreed is not None:
            end = min(end, agreed)
        return max(0, min(end - start, int(tokens.shape[0])))

    def target_forward(self, runner, slots, tokens, starts, logits_to_keep: int) -> torch.Tensor:
        """Verification (and prefill): the shallow view on the positions the draft did not
        run, then the deep view on every position from the kept hidden states."""
        missing = []
        for i, (s, t) in enumerate(zip(slots, tokens)):
            done = self._reusable(s, t, starts[i])
            if done:
                offset = starts[i] - self.pending_start[s]
                self.pending[s], self.pending_start[s] = self.pending[s][offset:offset + done], starts[i]
            else:
                self.pending[s] = None  # not what the draft ran (a prefill, another source's draft): recompute
            self.drafted.forget(s)
            if done < t.shape[0]:
                missing.append((i, done))
        if all(d == 0 for _, d in missing) and len(missing) == len(slots):
            # no row drafted (a plain step, a prefill): the full model in one pass, as plain decoding
            for s in slots:
                self.pending[s] = None
            return runner.forward(slots, tokens, starts, logits_to_keep=logits_to_keep).logits
        if missing:
            with _no_head(runner.model):  # only the hidden states of the shallow view are needed here
                self._forward([slots[i] for i, _ in missing], [tokens[i][d:] for i, d in missing],
                              [starts[i] + d for i, d in missing])
        hidden = [self.pending[s] for s in slots]
        for s in slots:
            self.pending[s] = None
        with self.views.deep():
            return runner.forward(slots, hidden, starts, logits_to_keep=logits_to_keep).logits


@contextlib.contextmanager
def _no_head(model):
    """The model's output layer returns nothing worth computing inside the block (a pass whose
    logits are not read)."""
    head = model.get_output_embeddings()
    if head is None:
        yield
        return
    head.forward = lambda x: x.new_zeros(x.shape[:-1] + (1,))
    try:
        yield
    finally:
        del head.forward


def build(inputs) -> EarlyExitProposer:
    """The method's factory (:class:`~pipeline.engine.proposers.base.ProposerInputs`).

    Raises:
        ValueError: ``assistant_early_exit`` outside ``1 .. num_hidden_layers - 1``, or a
            target whose layers the engine cannot split.
    """
    p = Params.of(inputs.spec)
    return EarlyExitProposer(inputs.target, p.assistant_early_exit, p.assistant_confidence_threshold)


def tune_candidate(settings, models) -> dict | None:
    """The tuner tries it with the job's exit layer (``assistant_early_exit``), else with the
    one the target's config names (``early_exit_layer``: a LayerSkip checkpoint)."""
    layers = settings.assistant_early_exit
    if layers is None:
        layers = getattr(models.target.config, "early_exit_layer", None)
    if isinstance(layers, int) and not isinstance(layers, bool):
        return {"assistant_early_exit": layers}
    return None
