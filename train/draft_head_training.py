"""Training a draft head (:class:`~pipeline.engine.draft_head.DraftHead`, method ``eagle``):
the training-time unroll, the training records and batches, the loss and one optimizer step.

Shared by ``train/train_smollm2_draft_head.py`` (the shipped head, from generated answers)
and ``jobs/train_drafter.py`` (training on a job's own outputs, teacher-forced).  The recipe
is EAGLE's (Li et al. 2024) with EAGLE-3's training-time test (arXiv 2503.01840): the head
is unrolled over whole sequences for draft positions ``1 .. S``, each fed its own previous
output, with the attention each draft position sees at inference (:func:`unrolled`).

A training *record* is one sequence (:func:`record`): its token ids, the target's features
at the stored layers ``(len-1, m, H)`` bfloat16 and its top-``K`` next-token
log-probabilities ``(len-1, K)`` at positions ``0 .. len-2``; ``prompt_len``, and ``kind``
(``"answer"``: a prompt and the target's answer; ``"news"``: plain text).
"""

from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F


# ----------------------------------------------------------------------------- the unroll
def unrolled(head, p: torch.Tensor, e: torch.Tensor, steps: int, valid: torch.Tensor | None = None,
         keep: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Training-time test (EAGLE-3): the head run ``steps`` times over whole sequences,
    step ``s`` fed its own step ``s - 1`` output as the feature, with the attention each
    draft position sees at inference.

    At head position ``j`` step 1 reads the target's ``p_j`` and ``e_j = emb(x_{j+1})``
    and attends causally to step-1 keys; step ``s > 1`` reads ``g^{s-1}_{j-1}`` and
    ``e_j`` and attends to step-1 keys at positions ``<= j - s + 1`` and to the step-``t``
    key at position ``j - s + t`` for ``t = 2 .. s`` -- exactly the real and speculative
    entries a query of draft position ``s`` at main position ``j`` reads in
    :class:`~pipeline.engine.proposers.eagle.EagleProposer`
    (``tests/engine/test_eagle.py`` checks it).  Valid outputs of step ``s`` are
    ``j >= s - 1``.

    Args:
        p: ``(B, T, H)`` the target's features ``p_0 .. p_{T-1}``.
        e: ``(B, T, H)`` embeddings of ``x_1 .. x_T``.
        steps: ``S >= 1``.
        valid: ``(B, T)`` bool, real (not padding) positions; padding is right-aligned.
        keep: per step, ``(B, T)`` bool positions whose output is returned (default: all).

    Returns:
        per step ``s``, the output features ``g^s`` ``(B, T, H)`` (or, with ``keep``,
        ``g^s[keep[s-1]]`` ``(n_s, H)``).
    """
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    B, T, H = p.shape
    attn = head.layer.self_attn
    nh, nkv, d = head.head_config.num_attention_heads, head.head_config.num_key_value_heads, head.head_config.head_dim
    pos = torch.arange(T, device=p.device).view(1, -1).expand(B, T)
    cos, sin = head.rotary_emb(p, position_ids=pos)
    if valid is None:
        valid = torch.ones(B, T, dtype=torch.bool, device=p.device)
    j = torch.arange(T, device=p.device)
    outs, keys, values = [], [], []
    feat = p
    for s in range(1, steps + 1):
        if s > 1:
            feat = torch.cat([feat.new_zeros(B, 1, H), g[:, :-1]], dim=1)  # g^{s-1}_{j-1} at j
        z = head.combine(feat, e)
        h = head.layer.input_layernorm(z)
        q = attn.q_proj(h).view(B, T, nh, d).transpose(1, 2)
        k = attn.k_proj(h).view(B, T, nkv, d).transpose(1, 2)
        v = attn.v_proj(h).view(B, T, nkv, d).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
        keys.append(k)
        values.append(v)
        # step-1 keys at positions <= j - s + 1 (and real), then one diagonal key per later step
        allowed = (j.view(1, -1) <= j.view(-1, 1) - s + 1).view(1, 1, T, T) & valid.view(B, 1, 1, T)
        scores = [torch.matmul(q, keys[0].transpose(-1, -2)) * attn.scaling]
        low = torch.finfo(scores[0].dtype).min  # (bfloat16 under autocast)
        scores[0] = scores[0].masked_fill(~allowed, low)
        vals = []
        for t in range(2, s + 1):
            shift = s - t  # key of step t at position j - shift
            kt = keys[t - 1] if shift == 0 else torch.cat([keys[t - 1].new_zeros(B, nh, shift, d), keys[t - 1][:, :, :-shift]], 2)
            vt = values[t - 1] if shift == 0 else torch.cat([values[t - 1].new_zeros(B, nh, shift, d), values[t - 1][:, :, :-shift]], 2)
            sc = (q * kt).sum(-1, keepdim=True) * attn.scaling
            if shift:
                sc = sc.masked_fill((j < shift).view(1, 1, T, 1), low)
            scores.append(sc)
            vals.append(vt)
        scores = torch.cat(scores, dim=-1)
        half = scores.dtype in (torch.float16, torch.bfloat16)
        probs = torch.softmax(scores.float() if half else scores, dim=-1).to(q.dtype)
        o = torch.matmul(probs[..., :T], values[0])
        for i, vt in enumerate(vals):
            o = o + probs[..., T + i : T + i + 1] * vt
        o = attn.o_proj(o.transpose(1, 2).reshape(B, T, nh * d))
        x = z + o
        g = x + head.layer.mlp(head.layer.post_attention_layernorm(x))
        outs.append(g if keep is None else g[keep[s - 1]])
    return outs


# ----------------------------------------------------------------------------- records
def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(T, V)`` logits -> top-k log-probabilities (float16) and ids (int32)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    v, i = logp.topk(k, dim=-1)
    return v.half(), i.int()


def record(ids, prompt_len, feats, topv, topi, kind):
    """One training sequence: ``ids`` (its tokens), the target's stored-layer features
    ``(len-1, m, H)`` bfloat16 and top-k ``(len-1, K)`` of positions ``0 .. len-2``."""
    return {"ids": torch.tensor(ids, dtype=torch.int32), "prompt_len": prompt_len, "feats": feats,
            "topv": topv, "topi": topi, "kind": kind}


class Data:
    """Training or held-out records, with the stored layers mapped to the head's."""

    def __init__(self, records: list[dict], stored_layers: list[int]):
        self.records = records
        self.stored = list(stored_layers)

    def feature(self, rec: dict, layers: list[int], a: int, b: int) -> dict[int, torch.Tensor]:
        """``{layer: (b - a, H)}`` float32 features of positions ``a .. b-1``."""
        return {layer: rec["feats"][a:b, self.stored.index(layer)].float() for layer in layers}


# ----------------------------------------------------------------------------- batches, loss, step
def make_batch(data: Data, recs: list[dict], head, layers: list[int], max_len: int, rng: random.Random,
               prompt_fraction: float, answer_weight: float, steps: int, vocab_index: torch.Tensor):
    """Right-padded tensors of a batch of windows of up to ``max_len`` head positions.

    Returns ``p (B, T, H)`` (projected features, with grad through the head's projection),
    ``e (B, T, H)``, ``valid (B, T)``, per step the kept positions ``(B, T)`` bool and the
    loss targets at them, and the next-feature targets (for the regression loss).
    """
    wins = []
    for r in recs:
        n = r["ids"].shape[0] - 2  # head positions j = 0 .. len-3 (teacher at j + 1 <= len - 2)
        if n <= 0:
            continue
        if n > max_len:
            a = n - max_len if r["kind"] == "answer" else rng.randint(0, n - max_len)  # answers: keep the end
        else:
            a = 0
        wins.append((r, a, min(n, a + max_len)))
    T = max(b - a for _, a, b in wins)
    B = len(wins)
    H = head.head_config.hidden_size
    feats = {layer: torch.zeros(B, T, H) for layer in layers}
    ids = torch.zeros(B, T, dtype=torch.long)
    valid = torch.zeros(B, T, dtype=torch.bool)
    weight = torch.zeros(B, T)
    topv = torch.full((B, T, wins[0][0]["topv"].shape[1]), -30.0)
    topi = torch.zeros(B, T, wins[0][0]["topi"].shape[1], dtype=torch.long)
    nxt = torch.zeros(B, T, H)
    last = head.head_config.target_num_hidden_layers  # the final, normed hidden state (must be stored)
    for bi, (r, a, b) in enumerate(wins):
        m = b - a
        for layer, f in data.feature(r, layers, a, b).items():
            feats[layer][bi, :m] = f
        ids[bi, :m] = r["ids"][a + 1 : b + 1].long()
        valid[bi, :m] = True
        topv[bi, :m] = r["topv"][a + 1 : b + 1].float()
        topi[bi, :m] = r["topi"][a + 1 : b + 1].long()
        nxt[bi, :m] = r["feats"][a + 1 : b + 1, data.stored.index(last)].float()
        w = torch.zeros(m)
        j = torch.arange(a, b)
        answer = j + 1 >= r["prompt_len"] - 1
        w[answer] = answer_weight
        sampled = torch.rand(m, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))) < prompt_fraction
        w[~answer & sampled] = 1.0
        weight[bi, :m] = w
    # teacher distribution over the draft vocabulary
    idx = vocab_index[topi]  # (B, T, K) draft indices or -1
    logp = topv.masked_fill(idx < 0, float("-inf"))
    has = torch.isfinite(logp).any(-1)
    target_p = torch.softmax(logp.masked_fill(~has.unsqueeze(-1), 0.0), dim=-1)
    keep = (weight > 0) & has & valid
    keeps = []
    for s in range(1, steps + 1):
        k = keep.clone()
        k[:, : s - 1] = False
        keeps.append(k)
    return {"feats": feats, "ids": ids, "valid": valid, "weight": weight, "idx": idx.clamp_min(0), "p": target_p,
            "keeps": keeps, "top1": topi[..., 0], "next": nxt}


def head_loss(head, batch: dict, steps: int, step_decay: float, regression_weight: float, autocast: bool):
    """The training loss of one batch and per-step top-1 agreement with the target's argmax."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        p = head.project(batch["feats"])
        e = head.embed(batch["ids"])
        outs = unrolled(head, p, e, steps, valid=batch["valid"], keep=batch["keeps"])
        total = 0.0
        agree = []
        for s, g in enumerate(outs, start=1):
            k = batch["keeps"][s - 1]
            if not bool(k.any()):
                agree.append(float("nan"))
                continue
            logq = torch.log_softmax(head.logits(g).float(), dim=-1)  # (n, N)
            ce = -(batch["p"][k] * logq.gather(-1, batch["idx"][k])).sum(-1)
            w = batch["weight"][k]
            total = total + step_decay ** (s - 1) * (ce * w).sum() / w.sum()
            if regression_weight:  # EAGLE-1's feature regression: norm(g) -> the target's next feature
                reg = F.smooth_l1_loss(head.norm(g).float(), batch["next"][k], reduction="none").mean(-1)
                total = total + regression_weight * step_decay ** (s - 1) * (reg * w).sum() / w.sum()
            pred = head.draft_vocab[logq.argmax(-1)]
            agree.append(float((pred == batch["top1"][k]).float().mean()))
    return total, agree


def init_head(head, target, how: str = "identity") -> None:
    """Warm start.  ``how``: ``target-layer`` -- the decoder layer is a copy of the target's
    last layer; ``identity`` -- the same with its two output projections (attention
    ``o_proj``, MLP ``down_proj``) zeroed, so the layer starts as the identity and the head
    as ``lm_head(norm(z))``; ``random`` -- transformers' initialisation.  Always: the final
    norm is the target's, ``W_fc = [I I] / 2`` (normed feature + normed token embedding), and an
    own output layer starts as the target's rows."""
    with torch.no_grad():
        last = target.get_decoder().layers[-1]
        if how in ("target-layer", "identity"):
            head.layer.load_state_dict(last.state_dict())
        if how == "identity":
            head.layer.self_attn.o_proj.weight.zero_()
            head.layer.mlp.down_proj.weight.zero_()
        head.norm.weight.copy_(target.get_decoder().norm.weight)
        H = head.head_config.hidden_size
        head.fc.weight.copy_(torch.cat([torch.eye(H), torch.eye(H)], dim=1) * 0.5)
        if head.feature_proj is not None:
            m = len(head.head_config.feature_layers)
            head.feature_proj.weight.copy_(torch.cat([torch.eye(H)] * m, dim=1) / m)
        rows = target.get_output_embeddings().weight.index_select(0, head.draft_vocab)
        head.lm_head.weight.copy_(rows)


def make_optimizer(head, lr: float):
    """AdamW over the head's trainable parameters (weight decay 0.01 on matrices, none on
    norms), betas (0.9, 0.95); returns ``(optimizer, params)``."""
    params = [p for p in head.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": other, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    return opt, params


def lr_scale(frac: float, warmup: float) -> float:
    """The learning-rate factor: ``warmup`` (a ramp in ``(0, 1]``) times a cosine decay to
    10 % over ``frac`` in ``[0, 1]`` of the run."""
    return warmup * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def train_step(head, opt, params, batch: dict, steps: int, step_decay: float, regression_weight: float,
               autocast: bool, lr: float) -> tuple[float, list[float]]:
    """One AdamW step at learning rate ``lr`` on ``batch`` (:func:`make_batch`), gradients
    clipped to norm 1; returns the loss and the per-draft-position top-1 agreement."""
    for g in opt.param_groups:
        g["lr"] = lr
    loss, agree = head_loss(head, batch, steps, step_decay, regression_weight, autocast)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return float(loss.detach()), agree
