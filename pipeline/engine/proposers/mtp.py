"""MTP layers shipped in the target's checkpoint draft one token each.

DeepSeek-V3 (arXiv 2412.19437, §2.2) and GLM-4.5 ship ``num_nextn_predict_layers``
multi-token-prediction layers after the last decoder layer (transformers exposes the
count as ``config.num_mtp_layers`` and drafts with them when ``generate(use_mtp=True)``;
our method name is ``mtp``, our setting ``SpeculationSettings.num_mtp_layers``).  MTP
layer ``i`` at main position ``j`` combines ``hnorm(g_{i-1}[j])`` (``g_{-1}`` = the
target's last hidden state ``h[j]``) with ``enorm(embed(x[j+1+i]))``, runs one decoder
block and predicts ``x[j+2+i]`` through the target's own head; the target's embeddings
and head are shared, not copied.  Chaining ``n`` layers at the last position drafts
``n`` tokens.

The layers are transformers' own ``MtpModel`` (``transformers.modeling_layers``), loaded
by :func:`load_mtp` through ``MtpModel.from_pretrained`` -- the loader ``use_mtp=True``
uses, which reads the ``model.layers.{num_hidden_layers + i}.*`` keys of the checkpoint
files and renames them (``shared_head.norm`` -> ``post_norm``, the decoder block under
``mtp_block``, per-expert MoE weights fused).  Their KV cache is transformers'
``MtpCache`` (queries of depth ``i`` run ``i + 1`` tokens ahead).

Incremental state per row, never recomputed for accepted tokens:

- the target's last hidden states of committed positions (captured by
  :meth:`MTPProposer.target_forward`, which runs every target pass);
- per MTP layer ``i``, its KV entries (a :class:`SlotCache` whose slot ``j`` holds main
  position ``j``; the layer's RoPE position is ``j + 1 + i``) and outputs for main
  positions ``0 .. n_i - 1``.  An entry of layer ``i`` at position ``j`` read tokens up to
  ``x[j+1+i]``; after a verification that left ``valid_length`` tokens valid it survives
  iff ``j + 1 + i < valid_length`` (so a rejected draft invalidates ``i`` entries of layer
  ``i`` and only those are recomputed next step).  Of layer ``i >= 1`` these tokens include
  its own draft tokens: the entries survive only up to the first position where the
  verified token is not the drafted one (another source's draft verified in its place, its
  own cut; :class:`~.base.DraftedTokens`), whatever the verification accepted.

Rows draft together: MTP layer ``i`` runs once per step over every drafting row, each
feeding its own missing positions (a ragged, left-padded pass with per-row masks).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass

import torch

from ..methods import MethodParams, param, POSITIVE_INT
from ..runner import ModelLayout, ModelRunner
from .base import Draft, DraftedTokens, DraftRequest, Drafting, draft_tokens


@dataclass
class Params(MethodParams):
    """Method ``mtp``'s parameters."""

    num_mtp_layers: int | None = param(
        None, "method ``mtp`` only: how many of the checkpoint's MTP layers to chain (a draft of that many tokens, "
        "capped by ``num_assistant_tokens``); ``None``: all of them.  transformers' switch for these layers is "
        "``generate(use_mtp=True)``; the count is ``config.num_mtp_layers`` (``num_nextn_predict_layers`` in "
        "DeepSeek-V3 / GLM-4.5 configs).", POSITIVE_INT, what="MTP layers to chain")


# --------------------------------------------------------------------------- loading
def _checkpoint_keys(path: str) -> list[str] | None:
    """Tensor names of a local safetensors checkpoint (``None`` if ``path`` is not a local
    directory with safetensors files, e.g. a hub id: then loading itself decides)."""
    if not path or not os.path.isdir(path):
        return None
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return list(json.load(f)["weight_map"])
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    if not files:
        return None
    from safetensors import safe_open

    keys: list[str] = []
    for name in files:
        with safe_open(os.path.join(path, name), framework="pt") as f:
            keys.extend(f.keys())
    return keys


def _mtp_key_prefixes(target) -> list[str]:
    cfg = target.config.get_text_config()
    nh = cfg.num_hidden_layers
    return [f"model.layers.{nh + i}." for i in range(cfg.num_mtp_layers)]


def _register_mtp_key_patterns(target) -> None:
    """transformers finds the MTP keys through the patterns a model class lists in
    ``_keys_to_ignore_on_load_unexpected`` (``model\\.layers\\.61.*`` for DeepSeek-V3,
    46 / 92 for GLM-4.5-Air / GLM-4.5): the layer index of the released checkpoints.  A
    checkpoint of another depth (our tiny fixtures, a pruned model) keeps its MTP layers
    at ``model.layers.{num_hidden_layers}``: add that pattern on this instance only, so
    the same transformers loader finds them (and ``generate(use_mtp=True)`` too)."""
    patterns = list(getattr(target, "_keys_to_ignore_on_load_unexpected", None) or [])
    probes = [p + "x" for p in _mtp_key_prefixes(target)]
    missing = [p for p in probes if not any(re.search(pat, p) for pat in patterns)]
    if missing:
        extra = [re.escape(p[:-1]) + ".*" for p in missing]
        target._keys_to_ignore_on_load_unexpected = patterns + extra


def load_mtp(target, checkpoint: str | None = None, device=None):
    """The MTP layers of ``target``'s checkpoint as transformers' ``MtpModel``.

    This is the loading path of ``generate(use_mtp=True)`` (``MtpModel.from_pretrained``),
    placed like transformers places it: on the device of the target's last decoder layer
    (the target itself may be split with ``device_map``).

    Args:
        target: the loaded target (``from_pretrained``), e.g. ``DeepseekV3ForCausalLM`` or
            ``Glm4MoeForCausalLM``.
        checkpoint: the checkpoint directory or hub id (default: the one the target was
            loaded from, ``target.config.name_or_path``).
        device: where the MTP layers go (default: the target's last layer's device).

    Raises:
        ValueError: the config declares no MTP layers (``num_nextn_predict_layers`` /
            ``num_mtp_layers`` is 0 or absent), or the checkpoint has no MTP weights
            (e.g. one written by ``save_pretrained()`` of a plain model).
    """
    from transformers.modeling_layers import MtpModel

    cfg = target.config.get_text_config()
    n = getattr(cfg, "num_mtp_layers", None)
    if not n:
        raise ValueError(
            f"method 'mtp' needs MTP layers, but {type(target).__name__}'s config declares none "
            f"(num_mtp_layers / num_nextn_predict_layers = {n!r})"
        )
    path = checkpoint or target.config.name_or_path
    prefixes = _mtp_key_prefixes(target)
    keys = _checkpoint_keys(path)
    if keys is not None:
        for prefix in prefixes:
            if not any(k.startswith(prefix) for k in keys):
                raise ValueError(
                    f"method 'mtp': the checkpoint {path!r} has no MTP weights (no '{prefix}*' keys; the config "
                    f"declares num_mtp_layers={n}); a model saved with save_pretrained() has none"
                )
    _register_mtp_key_patterns(target)
    if device is None:
        device = _execution_device(target.get_decoder().layers[-1])
    restore = contextlib.nullcontext()
    if checkpoint is not None and checkpoint != target.config.name_or_path:
        restore = _name_or_path(target, checkpoint)
    with restore:
        try:
            mtp = MtpModel.from_pretrained(target, device_map={"": device})
        except (RuntimeError, OSError) as err:
            raise ValueError(f"method 'mtp': could not load the MTP weights of {path!r}: {err}") from err
    return mtp.eval()


def _execution_device(module) -> torch.device:
    """Where ``module`` runs: its parameters' device, or for a module whose weights
    accelerate offloads (parameters on "meta" between calls) its hook's execution device."""
    device = next(module.parameters()).device
    hook = getattr(module, "_hf_hook", None)
    if device.type == "meta" and getattr(hook, "execution_device", None) is not None:
        device = torch.device(hook.execution_device)
    return device


@contextlib.contextmanager
def _name_or_path(target, path):
    old = target.config.name_or_path
    target.config.name_or_path = path
    try:
        yield
    finally:
        target.config.name_or_path = old


# --------------------------------------------------------------------------- drafting
class Positions:
    """Per-position vectors ``(T, H)`` of main positions ``[start, start + T)`` of one row."""

    def __init__(self):
        self.start = 0
        self.data: torch.Tensor | None = None

    @property
    def end(self) -> int:
        return self.start + (0 if self.data is None else self.data.shape[0])

    def put(self, pos: int, x: torch.Tensor) -> None:
        """Store ``x`` ``(m, H)`` for positions ``pos ..``, dropping anything stored from ``pos`` on."""
        if self.data is None or self.data.shape[0] == 0:
            self.start, self.data = pos, x
            return
        if not self.start <= pos <= self.end:
            raise RuntimeError(f"MTP state out of step: storing position {pos}, holding [{self.start}, {self.end})")
        self.data = torch.cat([self.data[: pos - self.start], x], dim=0)

    def get(self, a: int, b: int) -> torch.Tensor:
        if a < self.start or b > self.end:
            raise RuntimeError(f"MTP state out of step: need [{a}, {b}), holding [{self.start}, {self.end})")
        return self.data[a - self.start : b - self.start]

    def move(self, src: list[int], dst: list[int]) -> None:
        """The vectors of positions ``src`` now belong at positions ``dst`` (a token tree's
        accepted path, :meth:`SlotCache.move`'s moves)."""
        if not src:
            return
        if min(src + dst) < self.start or max(src + dst) >= self.end:
            raise RuntimeError(f"state out of step: moving positions {src} to {dst}, holding [{self.start}, {self.end})")
        a = torch.tensor(src, dtype=torch.long, device=self.data.device) - self.start
        b = torch.tensor(dst, dtype=torch.long, device=self.data.device) - self.start
        self.data = self.data.clone()
        self.data[b] = self.data[a]

    def crop(self, end: int) -> None:
        if self.data is not None and end < self.end:
            self.data = self.data[: max(0, end - self.start)]

    def drop_before(self, pos: int) -> None:
        if self.data is not None and pos > self.start:
            cut = min(pos, self.end) - self.start
            self.data = self.data[cut:]
            self.start += cut


def store_hidden(stores: list[Positions], slots, tokens, starts, hidden: torch.Tensor) -> None:
    """Keep each row's hidden states of a left-padded target pass: ``hidden`` ``(b, m, H)``
    covers the last ``m`` inputs (a model may return fewer positions than it ran)."""
    m = hidden.shape[1]
    for i, (s, t, start) in enumerate(zip(slots, tokens, starts)):
        q = int(t.shape[0])
        got = min(m, q)
        stores[s].put(start + q - got, hidden[i, m - got:])


def rows_with_state(requests: list[DraftRequest], stores: list[Positions]) -> list[int]:
    """The requests (their indices) that can draft: the row's store of per-position state from
    the target's passes (``stores[slot]``: hidden states, a draft head's features) holds its
    position ``L - 2``, the newest a draft reads (``L``: the row's committed tokens), up to
    ``L - 1``.  A row with none yet (a one-token prompt's first step: no target pass has run
    on it) drafts nothing this step."""
    out = []
    for i, r in enumerate(requests):
        L, store = r.sequence.shape[1], stores[r.slot]
        if r.k > 0 and L >= 2 and store.end >= L - 1 and store.start <= L - 2:
            out.append(i)
    return out


class MTPProposer:
    """Drafts with the first ``num_layers`` MTP layers of ``mtp`` (one token per layer).

    Args:
        target: the target model (its embeddings and head are the MTP layers' own).
        mtp: transformers' ``MtpModel`` for ``target`` (see :func:`load_mtp`).
        num_layers: how many MTP layers to chain (``SpeculationSettings.num_mtp_layers``;
            ``None``: all in the checkpoint).  A step drafts ``min(k, num_layers)`` tokens.
    """

    def __init__(self, target, mtp, num_layers: int | None = None):
        total = len(mtp.layers)
        if num_layers is None:
            num_layers = total
        if num_layers > total:
            raise ValueError(f"num_mtp_layers={num_layers} but the checkpoint has {total} MTP layer(s)")
        types = getattr(mtp.config, "layer_types", None) or []
        if any(t != "full_attention" for t in types[:num_layers]):
            raise ValueError(f"method 'mtp' supports MTP layers with full attention; these are {types[:num_layers]}")
        self.target = target
        self.mtp = mtp
        self.num_layers = num_layers
        self.device = _execution_device(mtp.layers[0])
        self.embed_device = _execution_device(target.get_input_embeddings())
        self.runner: ModelRunner | None = None

    def models(self) -> list[tuple[object, str]]:
        return [(self.mtp, "MTP layers")]

    # ---- per-row state
    def bind(self, max_rows: int, target_runner) -> None:
        layout = ModelLayout(("full_attention",) * self.num_layers, None, target_runner.layout.context, None, False)
        self.runner = ModelRunner(self.mtp, max_rows, layout)
        self.runner.device = self.device
        self.hidden = [Positions() for _ in range(max_rows)]  # target's last hidden states h[j]
        self.outs = [[Positions() for _ in range(self.num_layers)] for _ in range(max_rows)]  # g_i[j]
        self.lengths = [[0] * self.num_layers for _ in range(max_rows)]  # layer i: positions 0 .. n_i - 1

        self.drafted = DraftedTokens(max_rows)  # per slot: its last draft's tokens (layers i >= 1 read them)
        self.agreed: list[int | None] = [None] * max_rows  # per slot: where the verified tokens left them

    def admit(self, slots, prompts) -> None:
        for s in slots:
            self.hidden[s] = Positions()
            self.outs[s] = [Positions() for _ in range(self.num_layers)]
            self.lengths[s] = [0] * self.num_layers
            self.drafted.forget(s)
            self.agreed[s] = None

    def target_forward(self, runner, slots, tokens, starts, logits_to_keep: int) -> torch.Tensor:
        """The target pass, keeping its last hidden states (``hidden_states[-1]``, what
        transformers' ``MTPCandidateGenerator`` feeds the MTP layers)."""
        out = runner.forward(slots, tokens, starts, logits_to_keep=logits_to_keep, output_hidden_states=-1)
        store_hidden(self.hidden, slots, tokens, starts, out.hidden_states[-1].to(self.device))
        for s, t, start in zip(slots, tokens, starts):  # the verified tokens against its own draft's
            self.agreed[s] = self.drafted.agreed(s, t, start)
            self.drafted.forget(s)
        return out.logits

    def rollback(self, slot: int, valid_length: int) -> None:
        self.hidden[slot].crop(valid_length)  # the target's own: valid for every committed token it ran
        lengths, outs = self.lengths[slot], self.outs[slot]
        own = valid_length if self.agreed[slot] is None else min(valid_length, self.agreed[slot])
        self.agreed[slot] = None
        for i in range(self.num_layers):
            keep = max(0, min(lengths[i], own - 1 - i))
            if keep < lengths[i]:
                outs[i].crop(keep)
                lengths[i] = keep
        # Older positions are never read again (each layer restarts at its own length).
        low = min(lengths)
        self.hidden[slot].drop_before(low)
        for o in outs:
            o.drop_before(low)

    def reserve(self, length: int) -> None:
        self.runner.cache.reserve(length)

    # ---- drafting
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafting = Drafting(requests)
        active = rows_with_state(requests, self.hidden)
        for layer in range(self.num_layers):
            rows = [i for i in active if min(requests[i].k, self.num_layers) > layer]
            if not rows:
                break
            reqs = [requests[i] for i in rows]
            slots = [r.slot for r in reqs]
            prev, ids, starts = [], [], []
            for i, r in zip(rows, reqs):
                a, b = self.lengths[r.slot][layer], r.sequence.shape[1] - 1
                prev.append(self.hidden[r.slot].get(a, b) if layer == 0 else self.outs[r.slot][layer - 1].get(a, b))
                ids.append(drafting.prefix(i)[0, a + 1 + layer : b + 1 + layer])
                starts.append(a)
            hidden = self._layer(layer, slots, ids, prev, starts)
            for j, (i, r) in enumerate(zip(rows, reqs)):
                q = ids[j].shape[0]
                self.outs[r.slot][layer].put(starts[j], hidden[j, hidden.shape[1] - q:])
                self.lengths[r.slot][layer] = r.sequence.shape[1] - 1
            logits = self.mtp._project_to_logits(hidden[:, -1:])[:, -1].to(reqs[0].sequence.device)
            chosen, qs, conf = draft_tokens(logits, reqs, [drafting.prefix(i) for i in rows])
            for j, (i, r) in enumerate(zip(rows, reqs)):
                drafting.append(i, chosen[j : j + 1], qs[j], conf[j])
                self.drafted.record(r.slot, r.sequence.shape[1] + drafting.count(i) - 1, chosen[j : j + 1])
        return drafting.drafts()

    def _layer(self, layer: int, slots, ids, prev, starts) -> torch.Tensor:
        """MTP layer ``layer`` over ragged rows: main positions ``starts[b] ..`` feed
        tokens ``ids[b]`` and hidden states ``prev[b]``; returns ``(b, Q, H)`` outputs."""
        runner = self.runner
        embeds = [self.mtp.embed_tokens(t.to(self.embed_device)).to(self.device) for t in ids]
        x, positions, write, kv_len, mask = runner.inputs(slots, embeds, starts)
        h, *_ = runner.inputs(slots, [p.to(self.device) for p in prev], starts)
        rope_positions = positions + 1 + layer  # MTP depth i runs i + 1 tokens ahead
        runner.cache.step(slots, write, kv_len)
        kwargs = {"position_embeddings": None}
        if self.mtp.rotary_emb is not None:
            rope_kwargs = {"layer_type": self.mtp.config.layer_types[layer]} if self.mtp.has_per_layer_rope else {}
            kwargs["position_embeddings"] = self.mtp.rotary_emb(x, position_ids=rope_positions, **rope_kwargs)
        try:
            hidden = self.mtp.layers[layer](x, h, attention_mask=mask, position_ids=rope_positions,
                                            cache=runner.cache, **kwargs)
        finally:
            runner.cache.current = None
        if self.mtp.use_shared_post_norm:
            hidden = self.mtp.shared_post_norm(hidden)
        return hidden


def build(inputs) -> MTPProposer:
    """The method's factory (:class:`~pipeline.engine.proposers.base.ProposerInputs`):
    ``drafter=`` is an already loaded :class:`MtpModel`, else the MTP layers are loaded
    from the target's checkpoint (:func:`load_mtp`).

    Raises:
        ValueError: a ``drafter=`` that is not an ``MtpModel``, or a checkpoint without
            MTP layers.
    """
    if inputs.drafter is not None and type(inputs.drafter).__name__ != "MtpModel":
        raise ValueError(
            "method 'mtp' drafts with the MTP layers of the target's checkpoint; drafter= must be None "
            f"(or their MtpModel), got {type(inputs.drafter).__name__}"
        )
    mtp = inputs.drafter if inputs.drafter is not None else load_mtp(inputs.target)
    return MTPProposer(inputs.target, mtp, Params.of(inputs.spec).num_mtp_layers)
