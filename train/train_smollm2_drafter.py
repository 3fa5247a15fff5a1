"""Distil a draft model for SmolLM2-135M-Instruct on CPU (``models/smollm2-135m-drafter``).

Run from the repository root, after ``python scripts/fetch_models.py``::

    python train/train_smollm2_drafter.py                       # the shipped run (~1 h on 2 threads)
    python train/train_smollm2_drafter.py --out /tmp/d --gen-minutes 0.5 --teacher-minutes 0.5 \\
        --train-minutes 1 --eval-rows 2                          # smoke run (~5 min)

Recipe (sequence- and token-level knowledge distillation, Kim & Rush 2016; Hinton et al. 2015):

1. **Prompts.**  XSum articles from ``../shared/data/xsum_helm_1000`` formatted exactly as the
   summarize job formats them for this model (``pipeline.prompts.PromptBuilder`` with the default
   task: the default summarize template inside SmolLM2's chat template).  Articles 0-199 are held
   out (they are the issue's evaluation set), and so are Spec-Bench and ``data/demo_prompts.jsonl``.
2. **Target-generated continuations** (``--gen-minutes``): the target's greedy answers (at most 64
   new tokens) to training prompts, shortest prompts first, generated in batches of 8 until the
   time budget is spent; the target's top-``--top-k`` log-probabilities at each answer position
   are kept from the same generation pass.
3. **Teacher pass** (``--teacher-minutes``): one target forward pass, keeping the top-k
   log-probabilities at every position, over (a) further prompts followed by their XSum
   reference summary (two thirds of the budget) and (b) plain English news text (WMT
   newstest2014, TICO-19) in 256-token chunks (one third), so the drafter also sees text that is
   not a summarization prompt.  The target runs in bfloat16 autocast for stages 2 and 3 (about
   twice as fast on this CPU; the targets are training data, not a reference).
4. **Student** (``--train-minutes``): a ``LlamaForCausalLM`` with the target's tokenizer and
   vocabulary (49,152), hidden ``--hidden`` (192), ``--layers`` (2) layers with an MLP of
   ``--intermediate`` (768), tied embeddings,
   whose embedding matrix starts as the target's projected on its top ``--hidden`` principal
   directions (``E_t V_k``, from the eigenvectors of ``E_t^T E_t``).  Loss: cross-entropy against
   the teacher's renormalized top-k distribution at every position that has one (the LM head
   runs only there), answer tokens weighted ``--answer-weight`` (4) times.  AdamW (0.9/0.95, weight decay 0.1), warm-up then cosine decay to
   10 %, gradient clipping 1.0, fp32.  Sized for CPU decoding, which is weight-memory-bound: the
   49,152 x hidden LM head dominates a small drafter, hence the narrow width.
5. **Evaluation**: top-1 agreement with the target on held-out answers (the target's own answers
   to XSum articles 0-7); the engine's ``draft_model`` method (k=5, greedy) against plain
   decoding on held-out prompts (XSum 0-7 and the first 8 demo prompts): identical outputs,
   acceptance rate, mean accepted length; and the measured per-token cost ratio (a drafter decode
   step over a target decode step, 1 thread, float32, KV cache after a real prompt, median).
6. **Output**: the checkpoint in bfloat16 (under 25 MB with the tokenizer), ``README.md`` (model
   card with every figure above, wall time and machine load) and ``training_summary.json``.

Every stage runs for a wall-clock budget, so the figures depend on the machine's load; the card
records the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DATA = REPO.parent / "shared" / "data"
HELD_OUT_XSUM = 200  # articles 0..199: the evaluation set


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load_xsum() -> list[dict]:
    """The XSum articles of ``../shared/data`` (:func:`pipeline.corpora.xsum_rows`, HELM's
    wrapper stripped) as ``{"text", "summary"}``, in file order."""
    from pipeline.corpora import xsum_rows

    return [{"text": r["text"], "summary": r["reference"].strip()} for r in xsum_rows(DATA)]


def news_text() -> list[str]:
    lines = []
    for p in (DATA / "wmt_newstest").glob("*newstest2014*.eng"):
        lines += p.read_text(encoding="utf-8").splitlines()
    for p in (DATA / "tico19_test").glob("en-fr.tico19-test.en"):
        lines += p.read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip()]


# ----------------------------------------------------------------------------- teacher side
class Sequence:
    """One training sequence: token ids, the index where the answer starts (``len(ids)``: no
    answer), its kind, and the teacher's top-k next-token log-probabilities for the positions
    ``target_from .. len(ids) - 2`` (a generated answer carries them for its answer only)."""

    def __init__(self, ids: list[int], answer_start: int, kind: str):
        self.ids = ids
        self.answer_start = answer_start
        self.kind = kind
        self.target_from = 0
        self.top_logp: torch.Tensor | None = None  # (len-1-target_from, k) float16
        self.top_idx: torch.Tensor | None = None  # (len-1-target_from, k) int32


@torch.inference_mode()
def generate_answers(target, tokenizer, prompts: list[list[int]], minutes: float, max_new: int, top_k: int,
                     batch: int = 8):
    """Greedy answers of the target to ``prompts`` (left-padded batches) until the budget is spent,
    with the target's top-k log-probabilities at every answer position (from the same pass)."""
    out: list[Sequence] = []
    deadline = time.time() + minutes * 60
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = target.generation_config.eos_token_id
    for b in range(0, len(prompts), batch):
        if time.time() > deadline:
            break
        chunk = prompts[b : b + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            gen = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                                  pad_token_id=pad, output_logits=True, return_dict_in_generate=True)
        step_logp = torch.log_softmax(torch.stack(gen.logits, dim=1).float(), dim=-1)  # (B, steps, V)
        for r, (p, row) in enumerate(zip(chunk, gen.sequences[:, width:].tolist())):
            answer = []
            for t in row:
                answer.append(t)
                if t == eos:
                    break
            s = Sequence(p + answer, len(p), "generated")
            s.target_from = len(p) - 1
            v, i = step_logp[r, : len(answer)].topk(top_k, dim=-1)
            s.top_logp, s.top_idx = v.half(), i.int()
            out.append(s)
        log(f"  generated {len(out)} answers")
    return out


@torch.inference_mode()
def teacher_pass(target, seqs: list[Sequence], top_k: int, minutes: float) -> list[Sequence]:
    """Fill each sequence's teacher top-k log-probs, until the budget is spent; returns those done."""
    done = []
    deadline = time.time() + minutes * 60
    for s in seqs:
        if time.time() > deadline:
            break
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = target(input_ids=torch.tensor([s.ids])).logits[0, :-1].float()
        logp = torch.log_softmax(logits, dim=-1)
        v, i = logp.topk(top_k, dim=-1)
        s.top_logp, s.top_idx = v.half(), i.int()
        done.append(s)
    return done


# ----------------------------------------------------------------------------- student side
def build_student(target, hidden: int, layers: int, intermediate: int, head_dim: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    tc = target.config
    heads = hidden // head_dim
    cfg = LlamaConfig(
        vocab_size=tc.vocab_size, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=1, head_dim=head_dim,
        max_position_embeddings=tc.max_position_embeddings, rms_norm_eps=tc.rms_norm_eps,
        rope_parameters=dict(tc.rope_parameters), tie_word_embeddings=True,
        bos_token_id=tc.bos_token_id, eos_token_id=tc.eos_token_id, pad_token_id=tc.pad_token_id,
    )
    student = LlamaForCausalLM(cfg)
    # embeddings: the target's, projected on its top `hidden` principal directions
    E = target.get_input_embeddings().weight.detach().float()  # (vocab, d_target)
    evals, evecs = torch.linalg.eigh(E.T @ E)  # ascending
    V = evecs[:, -hidden:].flip(-1)  # (d_target, hidden)
    P = E @ V
    P = P / P.pow(2).mean().sqrt() * 0.02 * 5  # a sensible scale for the tied head
    with torch.no_grad():
        student.get_input_embeddings().weight.copy_(P)
    student.tie_weights()
    return student


def kd_loss(student, batch: list[Sequence], answer_weight: float, pad: int):
    width = max(len(s.ids) for s in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for r, s in enumerate(batch):
        ids[r, : len(s.ids)] = torch.tensor(s.ids)
        mask[r, : len(s.ids)] = 1
    hidden = student.model(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, T, h)
    total, weight_sum, agree, n = 0.0, 0.0, 0, 0
    for r, s in enumerate(batch):
        a, L = s.target_from, len(s.ids) - 1
        logits = student.lm_head(hidden[r, a:L])  # (L - a, V): the LM head only where the teacher spoke
        logq = torch.log_softmax(logits.float(), dim=-1)
        p = torch.softmax(s.top_logp.float(), dim=-1)  # renormalized teacher top-k
        ce = -(p * logq.gather(-1, s.top_idx.long())).sum(-1)  # (L - a,)
        w = torch.ones(L - a)
        w[max(0, s.answer_start - 1 - a):] = answer_weight
        total = total + (ce * w).sum()
        weight_sum += float(w.sum())
        agree += int((logits.argmax(-1) == s.top_idx[:, 0].long()).sum())
        n += L - a
    return total / weight_sum, agree / max(n, 1)


def train_student(student, train: list[Sequence], minutes: float, lr: float, tokens_per_step: int, pad: int,
                  answer_weight: float, log_every: int = 10) -> dict:
    decay = [p for n, p in student.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in student.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    student.train()
    start = time.time()
    budget = minutes * 60
    warmup_s = min(60.0, budget * 0.05)
    rng = random.Random(0)
    order: list[int] = []
    step, tokens, losses = 0, 0, []
    while time.time() - start < budget:
        elapsed = time.time() - start
        frac = min(1.0, elapsed / budget)
        scale = min(1.0, (elapsed + 1) / warmup_s) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr * scale
        batch, n_tok = [], 0
        while n_tok < tokens_per_step:
            if not order:
                order = list(range(len(train)))
                rng.shuffle(order)
            s = train[order.pop()]
            batch.append(s)
            n_tok += len(s.ids)
        batch.sort(key=lambda s: len(s.ids))
        loss, agree = kd_loss(student, batch, answer_weight, pad)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += n_tok
        losses.append(loss.item())
        if step % log_every == 0:
            log(f"  step {step} tokens {tokens} loss {statistics.mean(losses[-log_every:]):.3f} "
                f"top1 {agree:.3f} lr {lr * scale:.2e} ({time.time() - start:.0f} s)")
    student.eval()
    return {"steps": step, "tokens": tokens, "final_loss": statistics.mean(losses[-20:]) if losses else None,
            "epochs": tokens / max(1, sum(len(s.ids) for s in train)), "seconds": round(time.time() - start, 1)}


@torch.inference_mode()
def heldout_metrics(student, seqs: list[Sequence], answer_weight: float, pad: int) -> dict:
    """Distillation loss and top-1 agreement with the target on held-out generated answers."""
    losses, agree, n = [], 0.0, 0
    for s in seqs:
        loss, a = kd_loss(student, [s], answer_weight, pad)
        losses.append(loss.item())
        agree += a * (len(s.ids) - 1 - s.target_from)
        n += len(s.ids) - 1 - s.target_from
    if not losses:
        return {"loss": float("nan"), "top1_agreement_answers": float("nan")}
    return {"loss": statistics.mean(losses), "top1_agreement_answers": agree / max(1, n)}


@torch.inference_mode()
def decode_step_seconds(model, prompt: list[int], steps: int = 24) -> float:
    """Median seconds of one cached decode step after prefilling ``prompt``."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    tok = out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = model(input_ids=tok, past_key_values=cache, use_cache=True, logits_to_keep=1)
        tok = out.logits[:, -1:].argmax(-1)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cost_ratio(target, student, prompts: list[list[int]], rounds: int = 3) -> dict:
    """Drafter/target per-token decode cost, measured alternately (1 thread, float32)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t_times, d_times = [], []
        for r in range(rounds):
            for p in prompts:
                t_times.append(decode_step_seconds(target, p))
                d_times.append(decode_step_seconds(student, p))
    finally:
        torch.set_num_threads(threads)
    t, d = statistics.median(t_times), statistics.median(d_times)
    return {"target_step_ms": round(t * 1e3, 2), "drafter_step_ms": round(d * 1e3, 2), "ratio": round(d / t, 4)}


def engine_acceptance(target, student, tokenizer, prompts: list[list[int]], k: int, max_new: int) -> dict:
    from pipeline.engine import GenerationSettings, SpeculationSettings, SpeculativeEngine

    plain = SpeculativeEngine(target, SpeculationSettings(method="plain"), tokenizer=tokenizer)
    spec = SpeculativeEngine(target, SpeculationSettings(method="draft_model", num_assistant_tokens=k),
                             drafter=student, tokenizer=tokenizer, drafter_tokenizer=tokenizer)
    gs = GenerationSettings(max_new_tokens=max_new)
    same, drafted, accepted, steps, new = 0, 0, 0, 0, 0
    for p in prompts:
        a = plain.generate(p, gs)
        b = spec.generate(p, gs)
        same += a.token_ids == b.token_ids
        st = b.stats
        drafted += st.draft_tokens
        accepted += st.accepted_tokens
        steps += st.verify_steps
        new += st.new_tokens
    return {"rows": len(prompts), "identical_to_plain": same, "k": k, "draft_tokens": drafted,
            "accepted_tokens": accepted, "acceptance_rate": round(accepted / max(1, drafted), 4),
            "mean_accepted_length": round(new / max(1, steps), 3)}


# ----------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's flags."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="models/cache/SmolLM2-135M-Instruct")
    ap.add_argument("--out", default="models/smollm2-135m-drafter")
    ap.add_argument("--gen-minutes", type=float, default=12)
    ap.add_argument("--teacher-minutes", type=float, default=16)
    ap.add_argument("--train-minutes", type=float, default=20)
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--tokens-per-step", type=int, default=2048)
    ap.add_argument("--answer-weight", type=float, default=4.0)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--eval-rows", type=int, default=8, help="held-out XSum articles (0..N-1) for evaluation")
    ap.add_argument("--eval-demo-rows", type=int, default=8, help="demo prompts (data/demo_prompts.jsonl) for evaluation")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def distillation_data(args, target, tokenizer, prompt_ids, xsum: list[dict], max_prompt: int) -> SimpleNamespace:
    """Recipe steps 1-3 and the held-out set: the training prompts (XSum from article
    ``HELD_OUT_XSUM`` on, at most ``max_prompt`` tokens), the target's answers to half of them,
    the teacher pass over the other half's references and news text, and the target's answers
    to XSum 0..eval_rows-1.  Returns the training sequences, their counts, the held-out prompts
    and the held-out sequences."""
    eos = target.generation_config.eos_token_id
    train_rows = [r for r in xsum[HELD_OUT_XSUM:]]
    random.Random(args.seed).shuffle(train_rows)
    train_prompts = [(prompt_ids(r["text"]), r) for r in train_rows]
    train_prompts = [(p, r) for p, r in train_prompts if len(p) <= max_prompt]
    half = len(train_prompts) // 2
    gen_pool, ref_pool = train_prompts[:half], train_prompts[half:]

    # 2. target-generated continuations, shortest prompts first (more answers per minute on a CPU)
    log(f"stage 1: target answers to up to {len(gen_pool)} training prompts ({args.gen_minutes} min)")
    ordered = [p for p, _ in sorted(gen_pool, key=lambda pr: len(pr[0]))]
    generated = generate_answers(target, tokenizer, ordered, args.gen_minutes, args.max_new_tokens, args.top_k)

    # 3. teacher pass over generated, reference and plain-news sequences (a third of the budget each)
    ref_seqs = []
    for p, r in ref_pool:
        s = tokenizer(r["summary"], add_special_tokens=False)["input_ids"] + [eos]
        ref_seqs.append(Sequence(p + s, len(p), "reference"))
    lines = news_text()
    random.Random(args.seed + 2).shuffle(lines)
    news_seqs, buf = [], []
    for line in lines:
        buf += tokenizer(line + "\n", add_special_tokens=False)["input_ids"]
        if len(buf) >= 256:
            news_seqs.append(Sequence(buf[:256], 256, "news"))
            buf = []
    log(f"stage 2: teacher pass ({args.teacher_minutes} min): up to {len(ref_seqs)} reference, "
        f"up to {len(news_seqs)} news sequences")
    m = args.teacher_minutes
    gen_done = generated
    ref_done = teacher_pass(target, ref_seqs, args.top_k, m * 2 / 3)
    news_done = teacher_pass(target, news_seqs, args.top_k, m / 3)
    train = gen_done + ref_done + news_done
    data_stats = {
        "generated_sequences": len(gen_done), "reference_sequences": len(ref_done), "news_sequences": len(news_done),
        "generated_answer_tokens": sum(len(s.ids) - s.answer_start for s in gen_done),
        "tokens": sum(len(s.ids) for s in train),
        "teacher_targets": sum(len(s.ids) - 1 - s.target_from for s in train),
    }
    log(f"  teacher targets for {len(train)} sequences, {data_stats['tokens']} tokens")

    # held-out: XSum 0..eval_rows-1 with the target's own answers
    held_prompts = [prompt_ids(r["text"]) for r in xsum[: args.eval_rows]]
    held_prompts = [p for p in held_prompts if len(p) <= max_prompt]
    held = generate_answers(target, tokenizer, held_prompts, 60, args.max_new_tokens, args.top_k)
    return SimpleNamespace(train=train, stats=data_stats, held_prompts=held_prompts, held=held)


def evaluate(args, target, tokenizer, prompt_ids, student, held_prompts: list[list[int]]) -> SimpleNamespace:
    """Recipe steps 5-6: save the student (bf16) in ``--out``, load it back as the job does
    (float32), and measure the engine's acceptance (k=5) on the held-out XSum prompts and the
    demo prompts, and the cost ratio."""
    from transformers import AutoModelForCausalLM

    out = REPO / args.out if not os.path.isabs(args.out) else Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    student.generation_config = target.generation_config
    student.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    drafter = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()

    log("stage 4: evaluation (engine acceptance, cost ratio)")
    demo = [json.loads(line)["text"] for line in open(REPO / "data" / "demo_prompts.jsonl", encoding="utf-8")]
    demo = demo[: args.eval_demo_rows]
    eval_prompts = held_prompts + [prompt_ids(t) for t in demo]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    acc_xsum = engine_acceptance(target, drafter, tokenizer, held_prompts, 5, args.max_new_tokens)
    acc_demo = engine_acceptance(target, drafter, tokenizer, eval_prompts[len(held_prompts):], 5, args.max_new_tokens)
    torch.set_num_threads(threads)
    cost = cost_ratio(target, drafter, eval_prompts[:4])
    log(f"  acceptance xsum {acc_xsum} demo {acc_demo} cost {cost}")
    return SimpleNamespace(out=out, acc_xsum=acc_xsum, acc_demo=acc_demo, cost=cost)


def main(argv: list[str] | None = None) -> int:
    """The recipe of the module's docstring, then ``training_summary.json`` and the model card
    in ``--out``.  0 when done, 2 when there is no target checkpoint."""
    args = parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.config import TaskConfig
    from pipeline.prompts import PromptBuilder

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.set_num_threads(args.threads)
    t_start = time.time()
    load_before = os.getloadavg()
    target_dir = REPO / args.target if not os.path.isabs(args.target) else Path(args.target)
    if not (target_dir / "config.json").is_file():
        print(f"error: no target checkpoint at {target_dir}; run python scripts/fetch_models.py", file=sys.stderr)
        return 2
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    builder = PromptBuilder(tokenizer, TaskConfig())
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def prompt_ids(text: str) -> list[int]:
        return builder.build(text)[1]

    data = distillation_data(args, target, tokenizer, prompt_ids, load_xsum(), max_prompt=700)

    # 4. student
    student = build_student(target, args.hidden, args.layers, args.intermediate)
    n_params = sum(p.numel() for p in student.parameters())
    log(f"stage 3: training the drafter ({n_params / 1e6:.2f} M parameters) for {args.train_minutes} min")
    before = heldout_metrics(student, data.held, args.answer_weight, pad)
    train_stats = train_student(student, data.train, args.train_minutes, args.lr, args.tokens_per_step, pad,
                                args.answer_weight)
    after = heldout_metrics(student, data.held, args.answer_weight, pad)
    log(f"  held-out before {before} after {after}")

    # 6. save (bf16), then evaluate the saved checkpoint as the job loads it (float32)
    ev = evaluate(args, target, tokenizer, prompt_ids, student, data.held_prompts)
    out = ev.out
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    summary = {
        "target": str(args.target), "args": vars(args), "parameters": n_params,
        "target_parameters": sum(p.numel() for p in target.parameters()),
        "config": {"hidden_size": args.hidden, "num_hidden_layers": args.layers, "intermediate_size": args.intermediate,
                   "num_attention_heads": args.hidden // 64, "num_key_value_heads": 1, "tie_word_embeddings": True},
        "data": data.stats, "training": train_stats, "heldout_before": before, "heldout_after": after,
        "acceptance_xsum_heldout": ev.acc_xsum, "acceptance_demo_prompts": ev.acc_demo, "cost": ev.cost,
        "checkpoint_bytes": size, "wall_minutes": round((time.time() - t_start) / 60, 1),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
        "torch": torch.__version__, "threads": args.threads,
    }
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "README.md").write_text(model_card(summary))
    log(f"done in {summary['wall_minutes']} min: {out} ({size / 1e6:.1f} MB)")
    return 0


def model_card(s: dict) -> str:
    a, d, t, c = s["args"], s["data"], s["training"], s["cost"]
    ax, ad = s["acceptance_xsum_heldout"], s["acceptance_demo_prompts"]
    return f"""---
license: apache-2.0
base_model: HuggingFaceTB/SmolLM2-135M-Instruct
pipeline_tag: text-generation
---

# smollm2-135m-drafter

A draft model for speculative decoding with **SmolLM2-135M-Instruct** as the target (the converted
`models/cache/SmolLM2-135M-Instruct` of `scripts/fetch_models.py`), distilled from it on CPU by
`train/train_smollm2_drafter.py` (see its docstring for the recipe). It shares the target's tokenizer
(49,152-token BPE, chat template included here), so it drafts with `method: draft_model`.

| | |
| --- | --- |
| architecture | `LlamaForCausalLM`, {s['config']['num_hidden_layers']} layers, hidden {s['config']['hidden_size']}, MLP {s['config']['intermediate_size']}, {s['config']['num_attention_heads']} heads of 64 / 1 KV head, tied embeddings |
| parameters | {s['parameters']:,} ({s['parameters'] / s['target_parameters']:.3f} of the target's {s['target_parameters']:,}) |
| storage | bfloat16 safetensors; the folder is {s['checkpoint_bytes'] / 1e6:.1f} MB with the tokenizer |
| initialisation | embeddings = the target's projected on its top {s['config']['hidden_size']} principal directions; the rest random |
| measured cost ratio c | **{c['ratio']}** (a drafter decode step {c['drafter_step_ms']} ms / a target decode step {c['target_step_ms']} ms; float32, 1 thread, KV cache after a real prompt, median) |

## Data

Held out from everything: XSum articles 0-199 of `../shared/data/xsum_helm_1000` (the evaluation set),
Spec-Bench and `data/demo_prompts.jsonl`. Training prompts are the other XSum articles, formatted as the
summarize job does for this model (default template inside the chat template).

- {d['generated_sequences']} prompts with the **target's own greedy answers** (at most {a['max_new_tokens']} new tokens; {d['generated_answer_tokens']:,} answer tokens),
- {d['reference_sequences']} prompts followed by the XSum reference summary,
- {d['news_sequences']} chunks of 256 tokens of English news text (WMT newstest2014, TICO-19).

The target's top-{a['top_k']} next-token log-probabilities come from its generation pass for the answers and
from one forward pass for the other sequences ({d['teacher_targets']:,} positions with targets, {d['tokens']:,} tokens in all;
the target ran in bfloat16 autocast for these passes).

## Training

Cross-entropy against the target's renormalized top-{a['top_k']} distribution (answer tokens weighted
{a['answer_weight']}×), AdamW (lr {a['lr']}, 0.9/0.95, weight decay 0.1), warm-up then cosine decay to 10 %,
{a['tokens_per_step']} tokens per step, fp32, {a['threads']} threads.
**{t['steps']} steps, {t['tokens']:,} tokens ({t['epochs']:.1f} passes) in {t['seconds'] / 60:.1f} min; final training loss {t['final_loss']:.3f}.**

Held-out (the target's own answers to XSum articles 0-{a['eval_rows'] - 1}): distillation loss
{s['heldout_before']['loss']:.3f} → **{s['heldout_after']['loss']:.3f}**, top-1 agreement with the target
{s['heldout_before']['top1_agreement_answers']:.3f} → **{s['heldout_after']['top1_agreement_answers']:.3f}** on the answer tokens.

## Acceptance against the target (held-out, greedy, k={ax['k']}, {a['max_new_tokens']} new tokens, this repo's engine)

| prompts | rows | identical to plain | acceptance rate | mean accepted length (tokens per target pass) |
| --- | ---: | ---: | ---: | ---: |
| XSum 0-{a['eval_rows'] - 1} (those of at most 700 prompt tokens) | {ax['rows']} | {ax['identical_to_plain']}/{ax['rows']} | {ax['acceptance_rate']:.3f} | {ax['mean_accepted_length']:.2f} |
| `data/demo_prompts.jsonl` (first {ad['rows']}) | {ad['rows']} | {ad['identical_to_plain']}/{ad['rows']} | {ad['acceptance_rate']:.3f} | {ad['mean_accepted_length']:.2f} |

(In float32 a greedy difference from plain decoding can only come at a near-tie of the target's top two logits.)

## Run

`python train/train_smollm2_drafter.py` with the defaults: {s['wall_minutes']} min wall time in all on a
{s['cpus']}-core machine shared with other jobs (load average before {s['load_average_before']}, after
{s['load_average_after']}); torch {s['torch']}. Every stage runs for a wall-clock budget, so step counts depend on
the machine's load. Figures: `training_summary.json`.

License: Apache-2.0, as the target it was distilled from.
"""


if __name__ == "__main__":
    sys.exit(main())
