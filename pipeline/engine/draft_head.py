"""The EAGLE draft head: its config, its modules and its checkpoint folder.

The model of method ``eagle`` (:mod:`pipeline.engine.proposers.eagle` drafts with it;
``train/draft_head_training.py`` holds its training-time unroll).  EAGLE (Li et al. 2024,
arXiv 2401.15077; EAGLE-3, arXiv 2503.01840) in DeepSeek-V3's MTP layout (arXiv
2412.19437, §2.2).  At main position ``j`` the head combines the target's feature ``h_j``
(its hidden state there, which predicts ``x_{j+1}``) with the next token and predicts the
token after it::

    p_j = h_j                                             one feature layer (EAGLE-1)
        = W_p [RMSNorm_1(h^(1)_j); ...; RMSNorm_m(h^(m)_j)]   several (EAGLE-3: low, mid, high)
    z_j = W_fc [RMSNorm_h(p_j); RMSNorm_e(emb(x_{j+1}))]  emb = the target's own input embeddings
    g_j = LlamaDecoderLayer(z_j)                          its own KV cache, RoPE at position j
    q(x_{j+2}) = softmax(W_out RMSNorm(g_j))               over the N draft-vocabulary ids only

For draft position ``i > 1`` the head is chained on its own output: ``g_{j-1}`` takes the
place of ``p_j`` (the target has not computed ``h_j`` for a drafted token).  The target's
embeddings are shared, never copied; ``W_out`` is the head's own (``N x H``) or, with
``tie_lm_head``, the rows of the target's output layer for the draft vocabulary (nothing
stored).

Reduced vocabulary (FR-Spec, Zhao et al. 2025, arXiv 2502.14856): the head scores only the
``N`` ids of ``draft_vocab`` (most frequent first); ``q`` is zero elsewhere.

Checkpoint: a folder with ``config.json`` (``model_type: specbatch_draft_head``, every
size, the target it was trained for, the feature layers and the draft vocabulary size) and
``model.safetensors`` (the head's tensors and ``draft_vocab``, the ``(N,)`` int64 target ids
of its outputs); :func:`load_draft_head` / :func:`save_draft_head`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from .runner import text_config

MODEL_TYPE = "specbatch_draft_head"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


# --------------------------------------------------------------------------- config
@dataclass
class DraftHeadConfig:
    """Every size of a draft head, and what it was trained for.

    Attributes:
        hidden_size: ``H``, the target's hidden size (the head's width: its output feature
            stands in for the target's).
        intermediate_size, num_attention_heads, num_key_value_heads, head_dim, hidden_act,
        rms_norm_eps, rope_parameters, max_position_embeddings: the decoder layer's
            (a Llama layer; RoPE as the target's).
        feature_layers: indices into the target's ``hidden_states`` (0 = embeddings, ``i`` =
            the output of decoder layer ``i - 1``, ``num_hidden_layers`` = the final, normed
            last hidden state), in the order they are concatenated.
        draft_vocab_size: ``N``, ids the head scores (``draft_vocab`` in the weights).
        tie_lm_head: the output layer is the target's output-layer rows of ``draft_vocab``
            (not stored) instead of the head's own.
        target: the target it was trained for (a path or hub id, for the record).
        target_model_type, target_vocab_size, target_num_hidden_layers: checked against the
            target the head is attached to.
        training: free-form facts of the training run (for the record).
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_parameters: dict
    max_position_embeddings: int
    feature_layers: list[int]
    draft_vocab_size: int
    target_vocab_size: int
    target_num_hidden_layers: int
    tie_lm_head: bool = True
    hidden_act: str = "silu"
    target: str = ""
    target_model_type: str = ""
    training: dict = field(default_factory=dict)
    model_type: str = MODEL_TYPE

    @classmethod
    def for_target(cls, target, feature_layers: list[int] | None = None, draft_vocab_size: int | None = None,
                   tie_lm_head: bool = True, intermediate_size: int | None = None) -> "DraftHeadConfig":
        """A head shaped for ``target`` (a loaded causal LM): its hidden size, heads, RoPE and
        context; ``feature_layers`` default to the last hidden state only, ``draft_vocab_size``
        to the whole vocabulary, the MLP width to the target's."""
        c = text_config(target)
        n_layers = c.num_hidden_layers
        layers = [n_layers] if feature_layers is None else [int(i) % (n_layers + 1) for i in feature_layers]
        rope = getattr(c, "rope_parameters", None) or {"rope_type": "default", "rope_theta": getattr(c, "rope_theta", 10000.0)}
        if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
            rope = rope.get("full_attention", next(iter(rope.values())))  # Gemma 3: per layer type
        heads = c.num_attention_heads
        return cls(
            hidden_size=c.hidden_size, intermediate_size=intermediate_size or c.intermediate_size,
            num_attention_heads=heads, num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
            rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)), rope_parameters=dict(rope),
            max_position_embeddings=c.max_position_embeddings, feature_layers=layers,
            draft_vocab_size=draft_vocab_size or c.vocab_size, target_vocab_size=c.vocab_size,
            target_num_hidden_layers=n_layers, tie_lm_head=tie_lm_head,
            target=str(getattr(target.config, "name_or_path", "") or ""), target_model_type=c.model_type,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DraftHeadConfig":
        if d.get("model_type") != MODEL_TYPE:
            raise ValueError(f"not a draft head config: model_type is {d.get('model_type')!r}, not {MODEL_TYPE!r}")
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})

    def fit_problems(self, target_config) -> list[str]:
        """What keeps this head from fitting a target of ``target_config`` (a model's config, or
        a model): its hidden size, its vocabulary, and the hidden states the head reads (a
        head that reads the final hidden state reads it of a target of the same depth).
        Empty: it fits.  The one rule of both checks (:func:`check_fit`)."""
        c = text_config(target_config)
        problems = []
        if c.hidden_size != self.hidden_size:
            problems.append(f"hidden size {c.hidden_size} != the head's {self.hidden_size}")
        if c.vocab_size != self.target_vocab_size:
            problems.append(f"vocabulary {c.vocab_size} != the {self.target_vocab_size} it was trained for")
        deepest = max(self.feature_layers)
        if c.num_hidden_layers < deepest or (
                c.num_hidden_layers != self.target_num_hidden_layers and deepest == self.target_num_hidden_layers):
            problems.append(f"{c.num_hidden_layers} layers, the head reads hidden_states {self.feature_layers} "
                            f"of a {self.target_num_hidden_layers}-layer target")
        return problems

    def llama_config(self):
        """The ``LlamaConfig`` of the head's decoder layer (SDPA attention)."""
        from transformers import LlamaConfig

        cfg = LlamaConfig(
            vocab_size=self.draft_vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=1, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim, hidden_act=self.hidden_act,
            rms_norm_eps=self.rms_norm_eps, rope_parameters=dict(self.rope_parameters),
            max_position_embeddings=self.max_position_embeddings, attention_bias=False, mlp_bias=False,
            bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
        )
        cfg._attn_implementation = "sdpa"
        return cfg


def check_fit(head: DraftHeadConfig, target_config, more: list[str] | None = None) -> None:
    """Raise ``ValueError`` naming every mismatch (:meth:`DraftHeadConfig.fit_problems`, then
    ``more``) unless a head of ``head`` fits a target of ``target_config`` (a config or a
    model).  The one check of both paths: the driver's, from the configs alone
    (:func:`pipeline.engine.proposers.eagle.check_drafter`), and the engine's, when the head is
    attached (:meth:`DraftHead.check_target`): the same head is refused with the same message."""
    problems = head.fit_problems(target_config) + list(more or [])
    if problems:
        raise ValueError(f"method 'eagle': the draft head (trained for {head.target or 'another target'!r}) does not "
                         "fit the target: " + "; ".join(problems))


# --------------------------------------------------------------------------- the head
class DraftHead(nn.Module):
    """The draft head's modules (see the module docstring for the math).

    Built from a :class:`DraftHeadConfig`; :meth:`attach` binds it to the target whose
    embeddings it reads (and, tied, whose output-layer rows it scores with).  ``config`` is
    the decoder layer's ``LlamaConfig`` (what :class:`ModelRunner` and the attention
    kernels read); ``head_config`` the head's own.
    """

    def __init__(self, config: DraftHeadConfig):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

        self.head_config = config
        self.config = config.llama_config()
        H, eps, m = config.hidden_size, config.rms_norm_eps, len(config.feature_layers)
        if m < 1:
            raise ValueError("a draft head needs at least one feature layer")
        self.feature_norms = nn.ModuleList([LlamaRMSNorm(H, eps) for _ in range(m)]) if m > 1 else None
        self.feature_proj = nn.Linear(m * H, H, bias=False) if m > 1 else None
        self.hnorm = LlamaRMSNorm(H, eps)
        self.enorm = LlamaRMSNorm(H, eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layer = LlamaDecoderLayer(self.config, layer_idx=0)
        self.rotary_emb = LlamaRotaryEmbedding(self.config)
        self.norm = LlamaRMSNorm(H, eps)
        self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
        if config.tie_lm_head:
            self.lm_head.weight.requires_grad_(False)  # the target's rows, set by attach()
        self.register_buffer("draft_vocab", torch.arange(config.draft_vocab_size, dtype=torch.long))
        self._embed: list = [None]  # the target's input embeddings (not a submodule: never saved)

    # ---- binding
    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def check_target(self, target) -> None:
        """Raise ``ValueError`` (:func:`check_fit`'s message) unless ``target`` fits this head:
        its config, and the draft vocabulary's ids (in the weights) within its vocabulary."""
        vocab = text_config(target).vocab_size
        ids_outside = int(self.draft_vocab.max()) >= vocab or int(self.draft_vocab.min()) < 0
        check_fit(self.head_config, target, ["draft vocabulary ids outside the target's vocabulary"] * ids_outside)

    def attach(self, target) -> "DraftHead":
        """Read the target's input embeddings (shared) and, tied, copy its output-layer rows of
        the draft vocabulary into ``lm_head`` (an ``N x H`` copy in memory, not stored)."""
        self.check_target(target)
        self._embed[0] = target.get_input_embeddings()
        if self.head_config.tie_lm_head:
            out = target.get_output_embeddings()
            if out is None:
                raise ValueError("method 'eagle': a tied draft head needs the target's output layer; it has none")
            # ordinary tensors even when called under inference mode (the packed kernels track weight versions)
            with torch.inference_mode(False), torch.no_grad():
                rows = out.weight.detach().index_select(0, self.draft_vocab.to(out.weight.device))
                self.lm_head.weight.data = rows.to(device=self.device, dtype=self.dtype).clone()
        return self

    def set_draft_vocab(self, ids: torch.Tensor) -> None:
        """Set the ``(N,)`` int64 target ids the head's outputs stand for."""
        ids = torch.as_tensor(ids, dtype=torch.long).view(-1)
        if ids.numel() != self.head_config.draft_vocab_size or ids.unique().numel() != ids.numel():
            raise ValueError(f"draft_vocab must be {self.head_config.draft_vocab_size} distinct ids, got {ids.numel()}")
        self.draft_vocab.copy_(ids)

    def truncate_vocab(self, n: int) -> None:
        """Keep only the first ``n`` draft-vocabulary ids (the most frequent, in a trained
        head) and their output rows: a cheaper head, a smaller ``q`` support."""
        if not 1 <= n <= self.head_config.draft_vocab_size:
            raise ValueError(f"draft_vocab_size must be in 1 .. {self.head_config.draft_vocab_size}, got {n}")
        if n == self.head_config.draft_vocab_size:
            return
        with torch.inference_mode(False):  # ordinary tensors, even under inference mode
            with torch.no_grad():
                w = self.lm_head.weight.data[:n].clone()
            self.lm_head = nn.Linear(self.head_config.hidden_size, n, bias=False, device=w.device, dtype=w.dtype)
            self.lm_head.weight.data = w
            self.lm_head.weight.requires_grad_(not self.head_config.tie_lm_head)
            self.draft_vocab = self.draft_vocab[:n].clone()
        self.head_config.draft_vocab_size = n

    # ---- the math
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """``emb(ids)`` with the target's embeddings, in the head's dtype and device."""
        emb = self._embed[0]
        if emb is None:
            raise RuntimeError("DraftHead.attach(target) must be called before drafting")
        return emb(ids.to(emb.weight.device)).to(device=self.device, dtype=self.dtype)

    def project(self, hidden_states) -> torch.Tensor:
        """The feature ``p`` ``(..., H)`` of a target pass: ``hidden_states`` is the model's
        tuple (``output_hidden_states``: all, or those of :attr:`feature_layers`)."""
        layers = self.head_config.feature_layers
        hs = [hidden_states[i].to(device=self.device, dtype=self.dtype) for i in layers]
        if self.feature_proj is None:
            return hs[0]
        return self.feature_proj(torch.cat([n(h) for n, h in zip(self.feature_norms, hs)], dim=-1))

    def combine(self, p: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """``z = W_fc [RMSNorm_h(p); RMSNorm_e(e)]``, ``(..., H)``."""
        return self.fc(torch.cat([self.hnorm(p), self.enorm(e)], dim=-1))

    def decode(self, z: torch.Tensor, position_ids: torch.Tensor, attention_mask, cache) -> torch.Tensor:
        """The decoder layer over ``z`` ``(b, q, H)`` at ``position_ids`` ``(b, q)``, with a
        4D additive mask and a KV cache (:class:`SlotCache`); returns ``g`` ``(b, q, H)``."""
        pe = self.rotary_emb(z, position_ids=position_ids)
        return self.layer(z, attention_mask=attention_mask, position_ids=position_ids, cache=cache, use_cache=True,
                          position_embeddings=pe)

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """``(..., N)`` draft-vocabulary logits of output features ``g``."""
        return self.lm_head(self.norm(g))


def load_draft_head(path: str, target=None, dtype: torch.dtype | None = None, device=None) -> DraftHead:
    """A draft head from its folder (``config.json`` + ``model.safetensors``).

    Args:
        path: the folder.
        target: when given, the head is checked against it, moved to its device and dtype
            (unless given) and attached (:meth:`DraftHead.attach`).
        dtype, device: where the head's weights go (default float32 on the CPU, or the
            target's).

    Raises:
        ValueError: no such folder, not a draft head's config, missing or misshapen tensors,
            or a target it does not fit.
    """
    from safetensors.torch import load_file

    with torch.inference_mode(False):  # ordinary parameters, even when called under inference mode
        return _load_draft_head(path, target, dtype, device)


def _load_draft_head(path, target, dtype, device) -> DraftHead:
    from safetensors.torch import load_file

    path = os.path.expanduser(str(path))
    cfg_file, weights = os.path.join(path, CONFIG_NAME), os.path.join(path, WEIGHTS_NAME)
    if not os.path.isfile(cfg_file) or not os.path.isfile(weights):
        raise ValueError(f"method 'eagle': {path!r} is not a draft head folder (needs {CONFIG_NAME} and {WEIGHTS_NAME})")
    with open(cfg_file) as f:
        config = DraftHeadConfig.from_dict(json.load(f))
    head = DraftHead(config)
    try:
        state = load_file(weights)
    except Exception as e:  # noqa: BLE001 - SafetensorError (a pickle, a truncated file) is no ValueError
        raise ValueError(f"method 'eagle': {weights!r} is not a safetensors file ({type(e).__name__}: {e}); "
                         "weights are read only as safetensors, never unpickled") from None
    expected = set(head.state_dict())
    if config.tie_lm_head:
        expected.discard("lm_head.weight")
    missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or extra:
        raise ValueError(f"method 'eagle': {weights!r} does not match its config (missing {missing}, unexpected {extra})")
    head.load_state_dict(state, strict=False)
    if target is not None:
        dev = device if device is not None else next(target.parameters()).device
        head.to(device=dev, dtype=dtype or next(p for p in target.parameters() if p.is_floating_point()).dtype)
        head.attach(target)
    else:
        head.to(device=device or "cpu", dtype=dtype or torch.float32)
    return head.eval()


def is_draft_head(path: str) -> bool:
    """Whether ``path`` is a local folder whose ``config.json`` has ``model_type: specbatch_draft_head``."""
    cfg_file = os.path.join(os.path.expanduser(str(path)), CONFIG_NAME)
    try:
        with open(cfg_file) as f:
            return json.load(f).get("model_type") == MODEL_TYPE
    except (OSError, ValueError):
        return False


def read_draft_head_config(path: str) -> DraftHeadConfig:
    """The :class:`DraftHeadConfig` of a draft-head folder (no weights read)."""
    with open(os.path.join(os.path.expanduser(str(path)), CONFIG_NAME)) as f:
        return DraftHeadConfig.from_dict(json.load(f))


def save_draft_head(head: DraftHead, path: str, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write ``config.json`` and ``model.safetensors`` (floating tensors in ``dtype``; a tied
    head's output rows are the target's and are not written)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    state = {}
    for k, v in head.state_dict().items():
        if k == "lm_head.weight" and head.head_config.tie_lm_head:
            continue
        state[k] = (v.to(dtype) if v.is_floating_point() else v).detach().cpu().contiguous()
    save_file(state, os.path.join(path, WEIGHTS_NAME), metadata={"format": "pt", "model_type": MODEL_TYPE})
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        json.dump(head.head_config.to_dict(), f, indent=2)
        f.write("\n")
