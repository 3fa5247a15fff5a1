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
- per MTP layer ``i``, its cache and outputs for main positions ``0 .. n_i - 1``.  An
  entry of layer ``i`` at position ``j`` read tokens up to ``x[j+1+i]``; after a
  verification that left ``valid_length`` tokens valid it survives iff
  ``j + 1 + i < valid_length`` (so a rejected draft invalidates ``i`` entries of layer
  ``i`` and only those are recomputed next step).
"""

from __future__ import annotations

import contextlib
import json
import os
import re

import torch

from .base import Draft, DraftRequest, empty_draft, draft_token


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
class _Positions:
    """Per-position vectors ``(1, T, H)`` of main positions ``[start, start + T)``."""

    def __init__(self):
        self.start = 0
        self.data: torch.Tensor | None = None

    @property
    def end(self) -> int:
        return self.start + (0 if self.data is None else self.data.shape[1])

    def put(self, pos: int, x: torch.Tensor) -> None:
        """Store ``x`` for positions ``pos ..``, dropping anything stored from ``pos`` on."""
        if self.data is None or self.data.shape[1] == 0:
            self.start, self.data = pos, x
            return
        if not self.start <= pos <= self.end:
            raise RuntimeError(f"MTP state out of step: storing position {pos}, holding [{self.start}, {self.end})")
        self.data = torch.cat([self.data[:, : pos - self.start], x], dim=1)

    def get(self, a: int, b: int) -> torch.Tensor:
        if a < self.start or b > self.end:
            raise RuntimeError(f"MTP state out of step: need [{a}, {b}), holding [{self.start}, {self.end})")
        return self.data[:, a - self.start : b - self.start]

    def crop(self, end: int) -> None:
        if self.data is not None and end < self.end:
            self.data = self.data[:, : max(0, end - self.start)]

    def drop_before(self, pos: int) -> None:
        if self.data is not None and pos > self.start:
            cut = min(pos, self.end) - self.start
            self.data = self.data[:, cut:]
            self.start += cut


class MTPProposer:
    """Drafts with the first ``num_layers`` MTP layers of ``mtp`` (one token per layer).

    Args:
        target: the target model (its embeddings and head are the MTP layers' own).
        mtp: transformers' ``MtpModel`` for ``target`` (see :func:`load_mtp`).
        num_layers: how many MTP layers to chain (``SpeculationSettings.num_mtp_layers``;
            ``None``: all in the checkpoint).  A step drafts ``min(k, num_layers)`` tokens.
    """

    adaptive = False

    def __init__(self, target, mtp, num_layers: int | None = None):
        total = len(mtp.layers)
        if num_layers is None:
            num_layers = total
        if num_layers > total:
            raise ValueError(f"num_mtp_layers={num_layers} but the checkpoint has {total} MTP layer(s)")
        from transformers.cache_utils import MtpCache

        self._cache_cls = MtpCache
        self.target = target
        self.mtp = mtp
        self.num_layers = num_layers
        self.device = _execution_device(mtp.layers[0])
        self.embed_device = _execution_device(target.get_input_embeddings())
        self.reset(None)

    # ---- per-row state
    def reset(self, target_cache=None) -> None:
        self.cache = self._cache_cls(config=self.mtp.config)
        self.hidden = _Positions()  # target's last hidden states h[j]
        self.outs = [_Positions() for _ in range(self.num_layers)]  # g_i[j]
        self.lengths = [0] * self.num_layers  # entries of layer i: positions 0 .. n_i - 1

    def target_forward(self, target, input_ids, cache, logits_to_keep: int) -> torch.Tensor:
        """The target pass, keeping its last hidden states (``hidden_states[-1]``, what
        transformers' ``MTPCandidateGenerator`` feeds the MTP layers)."""
        pos = cache.get_seq_length()
        out = target(
            input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=logits_to_keep, output_hidden_states=-1
        )
        self.hidden.put(pos, out.hidden_states[-1].to(self.device))
        return out.logits[0]

    def rollback(self, valid_length: int) -> None:
        self.hidden.crop(valid_length)
        for i in range(self.num_layers):
            keep = max(0, min(self.lengths[i], valid_length - 1 - i))
            if keep < self.lengths[i]:
                self.cache.layers[i].crop(keep - self.lengths[i])
                self.outs[i].crop(keep)
                self.lengths[i] = keep
        # Older positions are never read again (each layer restarts at its own length).
        low = min(self.lengths)
        self.hidden.drop_before(low)
        for o in self.outs:
            o.drop_before(low)

    # ---- drafting
    def propose(self, request: DraftRequest) -> Draft:
        seq = request.sequence
        L = seq.shape[1]
        n = min(request.k, self.num_layers)
        if L < 2 or self.hidden.end < L - 1 or n <= 0:
            return empty_draft(seq.device)  # no target hidden state yet (one-token prompt)
        ext = seq
        tokens: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        b = L - 1  # positions j < b have a committed hidden state
        for i in range(n):
            a = self.lengths[i]
            prev = self.hidden.get(a, b) if i == 0 else self.outs[i - 1].get(a, b)
            ids = ext[:, a + 1 + i : b + 1 + i].to(self.embed_device)
            position_ids = torch.arange(a + 1 + i, b + 1 + i, device=self.device).view(1, -1)
            out = self.mtp.forward_layer(i, prev, position_ids, self.cache, input_ids=ids)
            self.outs[i].put(a, out)
            self.lengths[i] = b
            logits = self.mtp._project_to_logits(out[:, -1:]).to(seq.device)[:, -1]
            token, q = draft_token(logits, ext, request)
            tokens.append(token)
            if request.want_probs:
                probs.append(q)
            ext = torch.cat([ext, token], dim=1)
        return Draft(tokens=torch.cat(tokens, dim=1)[0], probs=torch.cat(probs, dim=0) if request.want_probs else None)
