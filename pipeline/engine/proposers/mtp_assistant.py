"""A separate MTP drafter: a Gemma 4 ``*-assistant`` checkpoint drafts from the target's
last hidden state and KV cache.

transformers pairs ``Gemma4AssistantForCausalLM`` (e.g. ``google/gemma-4-E4B-it-assistant``)
with a Gemma 4 target in ``generate(assistant_model=...)`` through its
``SinglePositionMultiTokenCandidateGenerator``.  The assistant has no KV cache and no
prefill of its own: every one of its layers attends (cross-attention, no causal mask) to
the target's keys and values of the last non-shared layer of each attention type (the
``shared_kv_states`` a Gemma 4 target returns with ``return_shared_kv_states=True``).
Its input is ``[embed_target(x_last); h]`` -- the target's (scaled) embedding of the last
token and the hidden state that predicted it -- at the constant position of ``x_last``;
each drafted token feeds the next step with the assistant's own projected hidden state.

Per row this proposer keeps the target's last hidden states from its passes (run
through :meth:`MTPAssistantProposer.target_forward`; the one at the last committed
position but one is the first draft's ``h``).  The shared keys and values need no copy:
they are the target's own cache entries of the layers that store them
(``kv_sharing_modes == "store"``), read for each row up to its committed length (all
positions but the last; rejected draft positions are past it).  Rows draft together:
each draft position is one assistant pass over the drafting rows, their KV left-padded
to a common length with a padding mask, so the assistant's window (counted from the end)
reads each row's own most recent entries.

Drafts are thus a function of the committed tokens only: each equals the draft
recomputed from one uncached target pass.  transformers' generator differs in two
details that only change drafts, never the output (verification is lossless): it keeps
the KV entry of the first rejected position, and after a one-token target pass it gives
the assistant ``W`` sliding entries instead of ``W + 1``.
"""

from __future__ import annotations

import torch

from ..runner import text_config
from .base import Draft, DraftRequest, Drafting, draft_tokens
from .mtp import Positions, rows_with_state, store_hidden


def _is_gemma4_assistant(model) -> bool:
    return type(model).__name__.startswith(("Gemma4Assistant", "Gemma4UnifiedAssistant"))


def _storing_layers(config) -> dict[str, int]:
    """Layer kind -> index of the target layer whose keys and values the assistant reads
    (the last layer of that kind that stores them for the KV-shared layers)."""
    types = list(getattr(config, "layer_types", None) or [])
    modes = list(getattr(config, "kv_sharing_modes", None) or [])
    out: dict[str, int] = {}
    for i, kind in enumerate(types):
        if not modes or modes[i] == "store":
            out[kind] = i
    return out


class MTPAssistantProposer:
    """Args:
        target: a Gemma 4 target (``Gemma4ForConditionalGeneration`` /
            ``Gemma4ForCausalLM``, or Gemma 3n).
        assistant: its ``Gemma4AssistantForCausalLM`` (passed to the engine as ``drafter=``).

    Raises:
        ValueError: no assistant, an assistant that is not a Gemma 4 assistant, or one
            built for another target (``backbone_hidden_size`` / vocabulary differ).
    """

    def __init__(self, target, assistant):
        if assistant is None:
            raise ValueError("method 'mtp_assistant' needs the Gemma 4 assistant checkpoint as drafter=")
        if not _is_gemma4_assistant(assistant):
            raise ValueError(
                f"method 'mtp_assistant' needs a Gemma 4 assistant (Gemma4AssistantForCausalLM) as drafter, "
                f"got {type(assistant).__name__}"
            )
        if not type(target).__name__.startswith(("Gemma4", "Gemma3n")):
            raise ValueError(
                f"method 'mtp_assistant' drafts from the target's shared KV states, which only Gemma 4 / Gemma 3n "
                f"targets return; got {type(target).__name__}"
            )
        t_cfg = text_config(target)
        backbone = getattr(assistant.config, "backbone_hidden_size", None)
        if backbone != t_cfg.hidden_size:
            raise ValueError(
                f"method 'mtp_assistant': the assistant was built for a target of hidden size {backbone} "
                f"(backbone_hidden_size), the target's is {t_cfg.hidden_size}"
            )
        if text_config(assistant).vocab_size != t_cfg.vocab_size:
            raise ValueError(
                f"method 'mtp_assistant': assistant vocabulary {text_config(assistant).vocab_size} != "
                f"target vocabulary {t_cfg.vocab_size}"
            )
        self.target = target
        self.assistant = assistant
        self.embed = target.get_input_embeddings()
        self.layers = _storing_layers(t_cfg)
        self.runner = None
        self.hidden: list[Positions] = []

    def models(self) -> list[tuple[object, str]]:
        return []  # the assistant runs its own forward on the target's shared keys and values, unprepared

    def bind(self, max_rows: int, target_runner) -> None:
        self.runner = target_runner
        self.hidden = [Positions() for _ in range(max_rows)]

    def admit(self, slots, prompts) -> None:
        for s in slots:
            self.hidden[s] = Positions()

    def target_forward(self, runner, slots, tokens, starts, logits_to_keep: int) -> torch.Tensor:
        out = runner.forward(slots, tokens, starts, logits_to_keep=logits_to_keep, output_hidden_states=-1)
        store_hidden(self.hidden, slots, tokens, starts, out.hidden_states[-1])
        return out.logits

    def rollback(self, slot: int, valid_length: int) -> None:
        self.hidden[slot].crop(valid_length)
        self.hidden[slot].drop_before(valid_length - 1)  # the next draft reads position valid_length - 1

    def reserve(self, length: int) -> None:
        pass  # it reads the target's cache, which the engine sizes

    def _shared_kv(self, slots: list[int], lengths: list[int]):
        """Per kind, keys and values of positions ``0 .. lengths[b] - 1`` of each row,
        left-padded to the longest: ``(b, heads, T, head_dim)``, and the ``(b, T)`` mask."""
        T = max(lengths)
        device = self.runner.device
        mask = torch.zeros((len(slots), T), dtype=torch.long, device=device)
        kv = {}
        for kind, idx in self.layers.items():
            layer = self.runner.cache.layers[idx]
            k = layer.keys.new_zeros((len(slots), layer.keys.shape[1], T, layer.keys.shape[3]))
            v = layer.values.new_zeros((len(slots), layer.values.shape[1], T, layer.values.shape[3]))
            for b, (s, n) in enumerate(zip(slots, lengths)):
                k[b, :, T - n:] = layer.keys[s, :, :n]
                v[b, :, T - n:] = layer.values[s, :, :n]
            kv[kind] = (k, v)
        for b, n in enumerate(lengths):
            mask[b, T - n:] = 1
        return kv, mask

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafting = Drafting(requests)
        rows = rows_with_state(requests, self.hidden)
        if not rows:
            return drafting.drafts()
        reqs = [requests[i] for i in rows]
        lengths = [r.sequence.shape[1] - 1 for r in reqs]
        kv, mask = self._shared_kv([r.slot for r in reqs], lengths)
        hidden = torch.stack([self.hidden[r.slot].get(n - 1, n) for r, n in zip(reqs, lengths)])  # (b, 1, H)
        token = torch.stack([r.sequence[0, -1:] for r in reqs])  # (b, 1)
        position_ids = torch.tensor(lengths, dtype=torch.long, device=token.device).view(-1, 1)
        live = list(range(len(reqs)))  # positions in reqs (and in kv, mask) still drafting
        while live:
            index = torch.tensor(live, device=token.device)
            sub_kv = {kind: (k[index], v[index]) for kind, (k, v) in kv.items()} if len(live) < len(reqs) else kv
            embeds = torch.cat([self.embed(token.to(self.embed.weight.device)).to(hidden.device), hidden], dim=-1)
            o = self.assistant(inputs_embeds=embeds, position_ids=position_ids[index], shared_kv_states=sub_kv,
                               attention_mask=mask[index], use_cache=False)
            hidden = o.last_hidden_state
            sub = [reqs[j] for j in live]
            chosen, qs, conf = draft_tokens(o.logits[:, -1].to(sub[0].sequence.device), sub,
                                      [drafting.prefix(rows[j]) for j in live])
            keep = []
            for pos, j in enumerate(live):
                drafting.append(rows[j], chosen[pos : pos + 1], qs[pos], conf[pos])
                if drafting.count(rows[j]) < reqs[j].k:
                    keep.append(pos)
            live = [live[p] for p in keep]
            token, hidden = chosen[keep].view(-1, 1), hidden[keep]
        return drafting.drafts()


def build(inputs) -> MTPAssistantProposer:
    """The method's factory (:class:`~pipeline.engine.proposers.base.ProposerInputs`)."""
    return MTPAssistantProposer(inputs.target, inputs.drafter)


def check_pair(target_config, drafter_config, tokenizer, drafter_tokenizer) -> None:
    """The driver's check, from the configs alone: the assistant's vocabulary is the
    target's; raises ``ValueError``."""
    t, d = text_config(target_config).vocab_size, text_config(drafter_config).vocab_size
    if t != d:
        raise ValueError(f"assistant vocabulary {d} != target vocabulary {t}")
