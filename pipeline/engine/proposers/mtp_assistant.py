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

Per row this proposer keeps, from the latest target pass (run through
:meth:`MTPAssistantProposer.target_forward`):

- the target's last hidden states of that pass (the one at the last valid position is
  the first draft's ``h``);
- the shared keys and values, cut after verification to the tokens still in the
  target's cache (rejected draft positions removed), and for sliding-window layers at
  least the ``W + 1`` most recent entries the assistant's window mask reads.

Drafts are thus a function of the committed tokens only.  transformers' generator
differs in two details that only change drafts, never the output (verification is
lossless): it keeps the KV entry of the first rejected position, and after a one-token
target pass it gives the assistant ``W`` sliding entries instead of ``W + 1``.
"""

from __future__ import annotations

import torch

from .base import Draft, DraftRequest, empty_draft, draft_token
from .draft_model import text_config


def _is_gemma4_assistant(model) -> bool:
    return type(model).__name__.startswith(("Gemma4Assistant", "Gemma4UnifiedAssistant"))


class MTPAssistantProposer:
    """Args:
        target: a Gemma 4 target (``Gemma4ForConditionalGeneration`` /
            ``Gemma4ForCausalLM``, or Gemma 3n) that returns ``shared_kv_states``.
        assistant: its ``Gemma4AssistantForCausalLM`` (passed to the engine as ``drafter=``).

    Raises:
        ValueError: no assistant, an assistant that is not a Gemma 4 assistant, or one
            built for another target (``backbone_hidden_size`` / vocabulary differ).
    """

    adaptive = True

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
        self.window = getattr(text_config(assistant), "sliding_window", None)
        self.reset(None)

    def reset(self, target_cache=None) -> None:
        self.hidden = None  # (1, m, H): last hidden states of positions [hidden_start, hidden_start + m)
        self.hidden_start = 0
        self.kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.kv_end = 0  # the shared KV ends at this absolute position

    def target_forward(self, target, input_ids, cache, logits_to_keep: int) -> torch.Tensor:
        pos = cache.get_seq_length()
        out = target(
            input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=logits_to_keep,
            output_hidden_states=-1, return_shared_kv_states=True,
        )
        hidden = out.hidden_states[-1]
        # Gemma 4 may run its KV-shared layers on the last `logits_to_keep` positions only
        self.hidden_start = pos + input_ids.shape[1] - hidden.shape[1]
        self.hidden = hidden
        end = pos + input_ids.shape[1]
        kv = {}
        for name, (k, v) in out.shared_kv_states.items():
            # A sliding-window layer returns only its window (W - 1 past entries + this
            # pass), but the assistant's window mask (|q - kv| <= W) reads W + 1 entries:
            # prepend the older ones kept from the previous pass.
            start = end - k.shape[2]
            if name in self.kv and self.kv_end >= start:
                old_k, old_v = self.kv[name]
                old_start = self.kv_end - old_k.shape[2]
                if old_start < start:
                    k = torch.cat([old_k[:, :, : start - old_start], k], dim=2)
                    v = torch.cat([old_v[:, :, : start - old_start], v], dim=2)
            if self.window is not None and "sliding" in name:
                keep = self.window + 1 + input_ids.shape[1]  # still >= W + 1 after rejected positions go
                k, v = k[:, :, -keep:], v[:, :, -keep:]
            kv[name] = (k, v)
        self.kv = kv
        self.kv_end = end
        return out.logits[0]

    def rollback(self, valid_length: int) -> None:
        drop = self.kv_end - valid_length
        if drop > 0:
            self.kv = {name: (k[:, :, :-drop], v[:, :, :-drop]) for name, (k, v) in self.kv.items()}
            self.kv_end = valid_length

    def propose(self, request: DraftRequest) -> Draft:
        seq = request.sequence
        L = seq.shape[1]
        i = L - 2 - self.hidden_start  # the hidden state that predicted the last token
        if self.hidden is None or not 0 <= i < self.hidden.shape[1] or self.kv_end != L - 1:
            return empty_draft(seq.device)  # one-token prompt: no target pass yet
        hidden = self.hidden[:, i : i + 1]
        token = seq[:, -1:]
        position_ids = torch.tensor([[L - 1]], dtype=torch.long, device=seq.device)
        ext = seq
        tokens: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        for _ in range(request.k):
            embeds = torch.cat([self.embed(token.to(self.embed.weight.device)).to(hidden.device), hidden], dim=-1)
            out = self.assistant(inputs_embeds=embeds, position_ids=position_ids, shared_kv_states=self.kv, use_cache=False)
            hidden = out.last_hidden_state
            logits = out.logits[:, -1].to(seq.device)
            token, q = draft_token(logits, ext, request)
            tokens.append(token)
            if request.want_probs:
                probs.append(q)
            ext = torch.cat([ext, token], dim=1)
        return Draft(tokens=torch.cat(tokens, dim=1)[0], probs=torch.cat(probs, dim=0) if request.want_probs else None)
