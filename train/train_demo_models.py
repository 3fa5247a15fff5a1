"""Train specbatch's bundled demo models on CPU from the corpora in ``../shared/data``.

Run from the repository root::

    python train/train_demo_models.py --out models            # ~45 min on 2 busy CPU threads

It writes three standard Hugging Face checkpoints (``from_pretrained`` loads each of
them, tokenizer included), saved in bfloat16 so that together they stay well under
40 MB:

``models/demo-target``
    ``LlamaForCausalLM`` (~11 M parameters, 8 layers, hidden 320) trained with a
    LayerSkip-style early-exit loss: the cross-entropy of the shared LM head applied,
    after the final norm, to the output of layer ``EARLY_EXIT_LAYER`` is added to the
    usual loss with weight ``EARLY_EXIT_WEIGHT``.  The first ``EARLY_EXIT_LAYER``
    layers + final norm + LM head therefore form a usable self-speculative drafter.
    The layer is stored in ``config.json`` as ``early_exit_layer``.
``models/demo-drafter``
    ``LlamaForCausalLM`` (~1 M parameters, 2 layers, hidden 128) with the *same*
    tokenizer; per-token FLOPs about 1/12 of the target's.  Trained on the same text
    with half cross-entropy, half KL divergence to the target's next-token
    distribution (distillation), so that its greedy choices agree with the target's;
    then fine-tuned the same way on the target's own greedy continuations of news
    prompts that no demo job uses (sequence-level distillation; ``--stage seqkd``
    reruns only this stage on saved checkpoints).
``models/demo-drafter-othertok``
    A 2-layer drafter with a *different* byte-level BPE tokenizer (2,048 tokens,
    digits split), for universal assisted decoding (drafter and target do not share
    a vocabulary).  Plain cross-entropy.

Training text (all public, see each folder's SOURCE.md):

* ``xsum_helm_1000/xsum_0shot.jsonl`` - 1,000 BBC articles with one-sentence
  summaries, formatted as article -> summary in three prompt templates (below).
* ``spec_bench/question.jsonl`` - the 80 CNN/DM summarization prompts with their
  reference highlights and the 80 WMT14 German->English translation prompts with
  their references.
* ``wmt_newstest/eng-deu.newstest2014.{deu,eng}`` - 3,003 German/English sentence
  pairs in the translation template.
* ``tinystories/tinystories_train_first2MiB.txt`` - the first 1,000 short stories
  (fluent simple English; capped so news text dominates the token budget).

Honesty note: the XSum and Spec-Bench rows the demo job runs on are *in* the
training data (minus a few held-out rows used for the validation loss).  These are
demo models that make speculation measurable on a CPU without downloads; they are not
an evaluation of summarization quality.

Prompt templates the models saw (the pipeline's templates should be one of these):

* ``Article: {article}\\nSummary: {summary}``
* ``###\\nArticle: {article}\\n\\nSummarize the above article in 1 sentence.\\nSummary: {summary}``
  (the XSum file's own HELM prompt, followed by ``Summary:``)
* ``Summarize: {article}\\n{summary}`` (Spec-Bench's prompt)
* ``Summarize the following article in a few sentences.\\n\\nArticle:\\n{article}\\n\\nSummary: {summary}``
  (the pipeline's default summarize template; drawn twice as often for XSum)
* ``Translate German to English: {german}\\n{english}`` (Spec-Bench's prompt)
* ``Translate the following text from German to English.\\n\\nGerman: {german}\\nEnglish: {english}``
  (the pipeline's default translate template)

Every document is ``<s> text </s>``; documents are packed into rows of
``--seq-len`` tokens (default 1024, long enough for a whole XSum article and its
summary); the tokenizer adds ``<s>`` itself when it encodes a prompt.
Optimiser: AdamW (betas 0.9/0.95, weight decay 0.1), linear warm-up then cosine decay
to 10 %, bf16 autocast on CPU, gradient clipping at 1.0.  Each model trains for a
wall-clock budget (``--target-minutes`` etc.), so the script ends predictably
(the step count therefore depends on the machine's load); the
step count reached is recorded in each model card.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data"

EARLY_EXIT_LAYER = 2
EARLY_EXIT_WEIGHT = 0.5
MAX_STORIES = 1000
SPECIALS = ["<s>", "</s>", "<unk>", "<pad>"]

TARGET_SHAPE = dict(hidden_size=320, intermediate_size=864, num_hidden_layers=8, num_attention_heads=5,
                    num_key_value_heads=5)
DRAFTER_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4)

HELM_SUFFIX = "\n\nSummarize the above article in 1 sentence.\n"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------- data
def load_corpus(data: Path, seed: int):
    """Return (train_docs, val_docs, stats).  A doc is (kind, prompt, response) and its
    text is ``prompt + response``; ``kind`` picks the template at packing time."""
    rng = random.Random(seed)
    train, val = [], []
    # XSum (HELM prompts): recover the raw article.
    xs = [json.loads(line) for line in open(data / "xsum_helm_1000" / "xsum_0shot.jsonl", encoding="utf-8")]
    for i, r in enumerate(xs):
        art = r["article"]
        if art.startswith("###\nArticle: "):
            art = art[len("###\nArticle: "):]
        if art.endswith(HELM_SUFFIX):
            art = art[: -len(HELM_SUFFIX)]
        doc = ("xsum", art.strip(), r["summary_gt"].strip())
        (val if i >= len(xs) - 10 else train).append(doc)
    # Spec-Bench summarization (CNN/DM) and translation (WMT14 de-en).
    for line in open(data / "spec_bench" / "question.jsonl", encoding="utf-8"):
        r = json.loads(line)
        if r["category"] == "summarization":
            art = r["turns"][0]
            art = art[len("Summarize: "):] if art.startswith("Summarize: ") else art
            train.append(("cnndm", art.strip(), r["reference"][0].strip()))
        elif r["category"] == "translation":
            de = r["turns"][0]
            de = de[len("Translate German to English: "):] if de.startswith("Translate German to English: ") else de
            train.append(("deen", de.strip(), r["reference"][0].strip()))
    de = open(data / "wmt_newstest" / "eng-deu.newstest2014.deu", encoding="utf-8").read().splitlines()
    en = open(data / "wmt_newstest" / "eng-deu.newstest2014.eng", encoding="utf-8").read().splitlines()
    for i, (d, e) in enumerate(zip(de, en)):
        if d.strip() and e.strip():
            (val if i >= len(de) - 30 else train).append(("deen", d.strip(), e.strip()))
    # TinyStories: drop the story cut mid-sentence after the last separator.
    raw = open(data / "tinystories" / "tinystories_train_first2MiB.txt", encoding="utf-8").read()
    stories = [s.strip() for s in raw.split("<|endoftext|>")[:-1] if s.strip()]
    # Only the first MAX_STORIES: the demo jobs are news summarization and translation,
    # the stories add fluent simple English without dominating the token budget.
    for i, s in enumerate(stories[:MAX_STORIES + 20]):
        (val if i >= MAX_STORIES else train).append(("story", s, ""))
    rng.shuffle(train)
    stats = {"xsum": len(xs), "spec_bench": 160, "wmt_pairs": len(de), "stories": len(stories)}
    return train, val, stats


def render(doc, rng: random.Random) -> tuple[str, str]:
    """(prompt, response) text of one document in one of the templates."""
    kind, a, b = doc
    if kind == "story":
        return a, ""
    if kind == "deen":
        if rng.random() < 0.5:
            return f"Translate German to English: {a}\n", b
        return f"Translate the following text from German to English.\n\nGerman: {a}\nEnglish:", " " + b
    if kind == "cnndm":
        t = rng.choice(["summarize", "article", "pipeline"])
    else:
        t = rng.choice(["article", "helm", "summarize", "pipeline", "pipeline"])
    if t == "pipeline":
        return f"Summarize the following article in a few sentences.\n\nArticle:\n{a}\n\nSummary:", " " + b
    if t == "article":
        return f"Article: {a}\nSummary:", " " + b
    if t == "helm":
        return f"###\nArticle: {a}{HELM_SUFFIX}Summary:", " " + b
    return f"Summarize: {a}\n", b


def corpus_text(docs, seed: int):
    rng = random.Random(seed)
    for d in docs:
        p, r = render(d, rng)
        yield p + r


# ---------------------------------------------------------------------- tokenizer
def train_tokenizer(docs, vocab_size: int, split_digits: bool, seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    bl = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), bl])
                         if split_digits else bl)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus_text(docs, seed), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", model_max_length=4096, clean_up_tokenization_spaces=False)
    return fast


def encode_docs(tokenizer, docs, seed: int, max_len: int):
    """Token ids ``<s> prompt response </s>`` per doc; an over-long prompt is cut so the
    response still fits."""
    rng = random.Random(seed)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    prompts, resps = [], []
    for d in docs:
        p, r = render(d, rng)
        prompts.append(p)
        resps.append(r)
    pi = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    ri = tokenizer(resps, add_special_tokens=False)["input_ids"]
    out = []
    for p, r in zip(pi, ri):
        r = r[: max_len // 4] if len(r) > max_len // 4 else r
        p = p[: max_len - 2 - len(r)]
        out.append([bos] + p + r + [eos])
    return out


def pack(seqs, max_len: int, pad_id: int, rng: random.Random):
    """Greedy packing of whole documents into rows of ``max_len`` (padding the rest)."""
    order = list(range(len(seqs)))
    rng.shuffle(order)
    rows, cur = [], []
    for i in order:
        s = seqs[i]
        if len(cur) + len(s) > max_len and cur:
            rows.append(cur)
            cur = []
        cur = cur + s
    if cur:
        rows.append(cur)
    ids = torch.full((len(rows), max_len), pad_id, dtype=torch.long)
    for j, r in enumerate(rows):
        ids[j, : len(r)] = torch.tensor(r[:max_len])
    labels = ids.clone()
    labels[ids == pad_id] = -100
    return ids, labels


class Batches:
    """Endless shuffled batches; every epoch re-renders templates and re-packs."""

    def __init__(self, tokenizer, docs, seq_len, batch, seed):
        self.tok, self.docs, self.seq_len, self.batch = tokenizer, docs, seq_len, batch
        self.seed, self.epoch = seed, 0
        self.tokens = 0
        self._new_epoch()
        self.epoch_tokens = int((self.labels != -100).sum())

    def _new_epoch(self):
        seqs = encode_docs(self.tok, self.docs, self.seed + self.epoch, self.seq_len)
        self.ids, self.labels = pack(seqs, self.seq_len, self.tok.pad_token_id, random.Random(self.seed + self.epoch))
        self.pos = 0
        self.epoch += 1

    def next(self):
        if self.pos + self.batch > len(self.ids):
            self._new_epoch()
        ids = self.ids[self.pos: self.pos + self.batch]
        lab = self.labels[self.pos: self.pos + self.batch]
        self.pos += self.batch
        self.tokens += int((lab != -100).sum())
        return ids, lab


# -------------------------------------------------------------------------- model
def make_model(tokenizer, shape, seed, max_pos=2048, **extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=max_pos, tie_word_embeddings=True,
                      rope_theta=10000.0, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id, **shape, **extra)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def count_params(model):
    total = sum(p.numel() for p in model.parameters())
    emb = model.model.embed_tokens.weight.numel()
    return total, total - emb


def flops_per_token(model):
    """~2 x (non-embedding weights + LM head): multiply-adds of one decode step."""
    _, non_emb = count_params(model)
    head = model.lm_head.weight.numel()
    return 2 * (non_emb + head)


def lr_at(step, total_est, peak, warmup):
    if step < warmup:
        return peak * (step + 1) / warmup
    prog = min(1.0, (step - warmup) / max(1, total_est - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * prog)))


def ce(logits, labels):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), labels[:, 1:].reshape(-1),
                           ignore_index=-100)


def train_loop(name, model, batches, minutes, peak_lr, loss_fn, log_every=20):
    """Train for a wall-clock budget with cosine decay over the *estimated* step count
    (re-estimated from the measured step time after a few steps)."""
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim < 2 else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=peak_lr, betas=(0.9, 0.95))
    budget = minutes * 60
    t0 = time.time()
    step, total_est, warmup = 0, 10_000, 30
    hist, loads = [], []
    model.train()
    while True:
        elapsed = time.time() - t0
        if elapsed >= budget:
            break
        if step == 5 or (step > 0 and step % 50 == 0):
            total_est = max(step + 1, int(budget / (elapsed / step)))
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total_est, peak_lr, warmup)
        ids, lab = batches.next()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, parts = loss_fn(model, ids, lab)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        hist.append({k: float(v.detach()) for k, v in parts.items()})
        step += 1
        if step % log_every == 0:
            loads.append(os.getloadavg()[0])
            avg = {k: sum(h[k] for h in hist[-log_every:]) / log_every for k in hist[-1]}
            log(f"{name} step {step}/{total_est} ep {batches.epoch} tok {batches.tokens / 1e6:.2f}M "
                + " ".join(f"{k}={v:.3f}" for k, v in avg.items())
                + f" lr={opt.param_groups[0]['lr']:.2e} {time.time() - t0:.0f}s")
    last = hist[-min(20, len(hist)):]
    final = {k: sum(h[k] for h in last) / len(last) for k in last[-1]}
    return {"steps": step, "tokens": batches.tokens, "epochs": batches.epoch, "epoch_tokens": batches.epoch_tokens,
            "seconds": time.time() - t0,
            "load_average": sum(loads) / len(loads) if loads else os.getloadavg()[0],
            "final_train_loss": final}


def target_loss(exit_layer, weight):
    def fn(model, ids, lab):
        out = model.model(input_ids=ids, output_hidden_states=True)
        final = ce(model.lm_head(out.last_hidden_state), lab)
        h_exit = model.model.norm(out.hidden_states[exit_layer])
        early = ce(model.lm_head(h_exit), lab)
        return final + weight * early, {"loss": final, f"exit{exit_layer}_loss": early}
    return fn


def distill_loss(teacher, alpha=0.5):
    def fn(model, ids, lab):
        with torch.no_grad():
            t_logits = teacher(input_ids=ids).logits.float()
        logits = model(input_ids=ids).logits.float()
        loss_ce = ce(logits, lab)
        mask = (lab != -100).reshape(-1)
        lp = F.log_softmax(logits.reshape(-1, logits.size(-1))[mask], -1)
        tp = F.log_softmax(t_logits.reshape(-1, t_logits.size(-1))[mask], -1)
        kl = F.kl_div(lp, tp, log_target=True, reduction="batchmean")
        return alpha * loss_ce + (1 - alpha) * kl, {"loss": loss_ce, "kl": kl}
    return fn


def plain_loss(model, ids, lab):
    loss = ce(model(input_ids=ids).logits, lab)
    return loss, {"loss": loss}


# ------------------------------------------------- sequence-level distillation
SEQKD_TEMPLATES = ("Summarize the following article in a few sentences.\n\nArticle:\n{text}\n\nSummary:",
                   "Article: {text}\nSummary:")


def seqkd_prompts(data: Path, sentences_per_article: int = 12):
    """News prompts for sequence-level distillation that no demo job runs on: the English
    side of WMT newstest2016 en-ro (``eng-ron.newstest2016.eng``), grouped into pseudo-articles
    of consecutive sentences, in the two summarize templates."""
    lines = [l.strip() for l in open(data / "wmt_newstest" / "eng-ron.newstest2016.eng", encoding="utf-8") if l.strip()]
    arts = [" ".join(lines[i:i + sentences_per_article]) for i in range(0, len(lines), sentences_per_article)]
    return [SEQKD_TEMPLATES[i % 2].format(text=a) for i, a in enumerate(arts)]


@torch.no_grad()
def generate_greedy(target, tokenizer, prompts, max_new_tokens, minutes):
    """The target's greedy continuations (what the drafter must predict at decode time)."""
    seqs, t0 = [], time.time()
    target.eval()
    for p in prompts:
        if time.time() - t0 > minutes * 60:
            break
        ids = tokenizer(p, return_tensors="pt")["input_ids"]
        out = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        seqs.append(out[0].tolist())
    return seqs


class SeqBatches:
    """Endless batches of whole (prompt + target continuation) sequences, one per row."""

    def __init__(self, seqs, pad_id, seed):
        self.seqs, self.pad_id, self.rng = seqs, pad_id, random.Random(seed)
        self.order, self.epoch, self.tokens, self.epoch_tokens = [], 0, 0, sum(len(s) for s in seqs)

    def next(self):
        if not self.order:
            self.order = list(range(len(self.seqs)))
            self.rng.shuffle(self.order)
            self.epoch += 1
        ids = torch.tensor([self.seqs[self.order.pop()]])
        self.tokens += ids.numel()
        return ids, ids.clone()


def seqkd_stage(target, drafter, tokenizer, data: Path, gen_minutes, train_minutes, seed):
    """Fine-tune the drafter on the target's own greedy outputs (prompts unseen by the jobs),
    with the same 0.5 CE + 0.5 KL objective: token-level distillation on natural text alone
    leaves the drafter guessing how the target behaves on its own generations."""
    prompts = seqkd_prompts(data)
    random.Random(seed).shuffle(prompts)
    seqs = generate_greedy(target, tokenizer, prompts, 48, gen_minutes)
    log(f"seqkd: {len(seqs)} target continuations generated")
    info = train_loop("drafter-seqkd", drafter, SeqBatches(seqs, tokenizer.pad_token_id, seed), train_minutes, 1e-3,
                      distill_loss(target))
    info["sequences"] = len(seqs)
    return info, seqs


# --------------------------------------------------------------------- evaluation
@torch.no_grad()
def val_metrics(model, batches_ids, batches_lab, exit_layer=None, teacher=None):
    """Held-out loss (and early-exit loss; top-1 agreement with ``teacher``)."""
    model.eval()
    tot = {"loss": 0.0, "exit": 0.0, "agree": 0, "n": 0}
    for ids, lab in zip(batches_ids, batches_lab):
        out = model.model(input_ids=ids, output_hidden_states=True)
        logits = model.lm_head(out.last_hidden_state).float()
        m = lab[:, 1:] != -100
        n = int(m.sum())
        tot["loss"] += float(ce(logits, lab)) * n
        tot["n"] += n
        if exit_layer is not None:
            el = model.lm_head(model.model.norm(out.hidden_states[exit_layer])).float()
            tot["exit"] += float(ce(el, lab)) * n
            tot["agree_exit"] = tot.get("agree_exit", 0) + int(((el.argmax(-1) == logits.argmax(-1))[:, :-1] & m).sum())
        if teacher is not None:
            tl = teacher(input_ids=ids).logits
            tot["agree"] += int(((tl.argmax(-1) == logits.argmax(-1))[:, :-1] & m).sum())
    model.train()
    res = {"val_loss": tot["loss"] / tot["n"]}
    if exit_layer is not None:
        res["val_exit_loss"] = tot["exit"] / tot["n"]
        res["val_top1_agreement_exit_vs_full"] = tot["agree_exit"] / tot["n"]
    if teacher is not None:
        res["val_top1_agreement_with_target"] = tot["agree"] / tot["n"]
    return res


def val_batches(tokenizer, docs, seq_len, seed, bs=4):
    seqs = encode_docs(tokenizer, docs, seed, seq_len)
    ids, lab = pack(seqs, seq_len, tokenizer.pad_token_id, random.Random(seed))
    return list(ids.split(bs)), list(lab.split(bs))


@torch.no_grad()
def decode_step_ms(model, prompt_len=512, steps=32):
    """Median wall time of one cached single-token decode step, fp32, after a prefill."""
    from transformers import DynamicCache

    model.eval()
    ids = torch.randint(10, model.config.vocab_size, (1, prompt_len))
    times = []
    for rep in range(2):
        cache = DynamicCache()
        out = model(input_ids=ids, cache=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            t = time.perf_counter()
            out = model(input_ids=nxt, cache=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - t)
    times.sort()
    return 1000 * times[len(times) // 2]


# ------------------------------------------------------------------------- saving
def save(model, tokenizer, path: Path, card: str):
    from transformers import GenerationConfig

    path.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id, do_sample=False,
                                               max_new_tokens=128)
    model.to(torch.bfloat16).save_pretrained(path)
    model.to(torch.float32)
    tokenizer.save_pretrained(path)
    (path / "README.md").write_text(card, encoding="utf-8")


def card(title, model, info, extra_lines):
    total, non_emb = count_params(model)
    c = model.config
    lines = [
        "---", "license: other", "library_name: transformers", "pipeline_tag: text-generation", "tags: [specbatch, demo, speculative-decoding]", "---", "",
        f"# {title}", "",
        "Tiny demo model trained on CPU by `train/train_demo_models.py` in the specbatch repository.",
        "It exists so that speculative decoding can be demonstrated and measured without downloads;",
        "it is **not** a useful summarizer or translator.", "",
        "## Architecture", "",
        f"- `LlamaForCausalLM`: {c.num_hidden_layers} layers, hidden {c.hidden_size}, MLP {c.intermediate_size}, "
        f"{c.num_attention_heads} heads, vocab {c.vocab_size}, tied embeddings, RoPE, max positions {c.max_position_embeddings}",
        f"- parameters: {total:,} ({non_emb:,} without the embedding)",
        "- weights stored in bfloat16; load with `AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)`",
        "",
        "## Data", "",
        "Public corpora from the project's `../shared/data` (see each folder's SOURCE.md): XSum HELM sample (1,000 BBC",
        "articles with one-sentence summaries, last 10 held out), Spec-Bench summarization (CNN/DM) and translation",
        "(WMT14 de-en) prompts with references, WMT newstest2014 de-en (3,003 pairs, last 30 held out), and the first",
        "1,000 stories of TinyStories (next 20 held out). The XSum and Spec-Bench rows the demo jobs run on are",
        "part of the training data; the figures below are for a demo, not an evaluation.",
        "Prompt templates: the pipeline's defaults (`Summarize the following article in a few sentences.\\n\\nArticle:\\n{text}\\n\\nSummary:`",
        "and `Translate the following text from German to English.\\n\\nGerman: {text}\\nEnglish:`), `Article: {article}\\nSummary: {summary}`,",
        "the XSum file's HELM prompt followed by `Summary:`, and Spec-Bench's `Summarize: {article}\\n` / `Translate German to English: {german}\\n`.",
        "",
        "## Training", "",
        f"- steps: {info['steps']}, tokens seen: {info['tokens']:,} (the packed training set holds {info['epoch_tokens']:,}), "
        f"wall time {info['seconds'] / 60:.1f} min on {info['threads']} CPU thread(s) ({_machine(info)})",
        f"- sequence length {info['seq_len']}, batch {info['batch']}, AdamW, peak LR {info['lr']}, warm-up then cosine to 10 %, bf16 autocast",
        "- final training loss (mean of the last 20 steps): " + ", ".join(f"{k} = {v:.3f}" for k, v in info["final_train_loss"].items()),
        "- held-out: " + ", ".join(f"{k} = {v:.3f}" for k, v in info["val"].items()),
    ]
    lines += extra_lines
    return "\n".join(lines) + "\n"


def _machine(info) -> str:
    """How loaded the machine was while this model trained (steps depend on it)."""
    load = info.get("load_average")
    if load is None:
        return "machine load not recorded"
    return f"{os.cpu_count()}-core machine, mean 1-min load average {load:.1f} during training"


def seqkd_card_lines(sinfo):
    return [
        "", "## Sequence-level distillation (second stage)", "",
        f"Then fine-tuned for {sinfo['steps']} steps ({sinfo['seconds'] / 60:.1f} min, {sinfo['tokens']:,} tokens, LR 1e-3) "
        f"with the same objective on {sinfo['sequences']} sequences made of a prompt and `demo-target`'s own greedy "
        "continuation (48 tokens at most). The prompts are pseudo-articles of 12 consecutive sentences from the English "
        "side of WMT newstest2016 en-ro (`wmt_newstest/eng-ron.newstest2016.eng`), which no demo job runs on, in the "
        "pipeline's summarize templates. The stage is there because token-level distillation on natural text alone "
        "once left the drafter agreeing with the target on only ~22 % of the target's own generated tokens (measured "
        "on XSum outputs). It fits the drafter to the target's generations at the cost of natural text: the held-out "
        "agreement below is on natural text, not on what the drafter is used for.",
        "- final training loss (mean of the last 20 steps): "
        + ", ".join(f"{k} = {v:.3f}" for k, v in sinfo["final_train_loss"].items()),
        "- held-out after this stage: " + ", ".join(f"{k} = {v:.3f}" for k, v in sinfo["val"].items()),
    ]


def seqkd_only(args, out: Path):
    """Rerun the drafter's sequence-level distillation on the saved checkpoints."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out / "demo-target")
    target = AutoModelForCausalLM.from_pretrained(out / "demo-target", dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    drafter = AutoModelForCausalLM.from_pretrained(out / "demo-drafter", dtype=torch.float32)
    drafter.config._attn_implementation = "sdpa"
    train_docs, val_docs, _ = load_corpus(Path(args.data), args.seed)
    vb = val_batches(tok, val_docs, args.seq_len, args.seed)
    sinfo, _ = seqkd_stage(target, drafter, tok, Path(args.data), args.seqkd_gen_minutes, args.seqkd_minutes,
                           args.seed + 3)
    sinfo["val"] = val_metrics(drafter, *vb, teacher=target)
    log(f"drafter seqkd done: {sinfo}")
    card_path = out / "demo-drafter" / "README.md"
    card_text = card_path.read_text(encoding="utf-8")
    card_text = card_text.split("\n## Sequence-level distillation")[0].rstrip("\n") + "\n"
    save(drafter, tok, out / "demo-drafter", card_text + "\n".join(seqkd_card_lines(sinfo)) + "\n")
    summ_path = out / "training_summary.json"
    summary = json.loads(summ_path.read_text()) if summ_path.exists() else {}
    summary["drafter_seqkd"] = sinfo
    summ_path.write_text(json.dumps(summary, indent=2, default=float))
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    """The command line's flags."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="models")
    ap.add_argument("--data", default=str(DEFAULT_DATA))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--target-minutes", type=float, default=30.0)
    ap.add_argument("--drafter-minutes", type=float, default=7.0)
    ap.add_argument("--othertok-minutes", type=float, default=3.0)
    ap.add_argument("--seqkd-gen-minutes", type=float, default=3.0,
                    help="time for the target to generate the drafter's sequence-level distillation data")
    ap.add_argument("--seqkd-minutes", type=float, default=5.0, help="drafter fine-tuning on those sequences")
    ap.add_argument("--stage", choices=["all", "seqkd"], default="all",
                    help="seqkd: only the drafter's sequence-level distillation, from the checkpoints in --out")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--other-vocab", type=int, default=2048)
    return ap.parse_args(argv)


def train_models(args, tok, tok2, train_docs, val_docs) -> dict:
    """The three trainings in turn: the target (early-exit loss), the drafter distilled from it
    (then its sequence-level distillation) and the drafter with ``tok2``.  Returns the models
    (``target``, ``drafter``, ``other``) and their training facts (``tinfo``, ``dinfo``,
    ``sinfo``, ``oinfo``)."""
    common = dict(threads=args.threads, seq_len=args.seq_len, batch=args.batch)

    # ---- target with early-exit loss
    target = make_model(tok, TARGET_SHAPE, args.seed, early_exit_layer=EARLY_EXIT_LAYER,
                        early_exit_loss_weight=EARLY_EXIT_WEIGHT)
    log(f"target params {count_params(target)}")
    vb = val_batches(tok, val_docs, args.seq_len, args.seed)
    tinfo = train_loop("target", target, Batches(tok, train_docs, args.seq_len, args.batch, args.seed),
                       args.target_minutes, 2e-3, target_loss(EARLY_EXIT_LAYER, EARLY_EXIT_WEIGHT))
    tinfo.update(common, lr=2e-3, val=val_metrics(target, *vb, exit_layer=EARLY_EXIT_LAYER))
    log(f"target done: {tinfo}")

    # ---- drafter, same tokenizer, distilled from the target
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    drafter = make_model(tok, DRAFTER_SHAPE, args.seed + 1)
    dinfo = train_loop("drafter", drafter, Batches(tok, train_docs, args.seq_len, args.batch, args.seed + 1),
                       args.drafter_minutes, 3e-3, distill_loss(target))
    dinfo.update(common, lr=3e-3, val=val_metrics(drafter, *vb, teacher=target))
    log(f"drafter done: {dinfo}")
    sinfo, _ = seqkd_stage(target, drafter, tok, Path(args.data), args.seqkd_gen_minutes, args.seqkd_minutes,
                           args.seed + 3)
    sinfo["val"] = val_metrics(drafter, *vb, teacher=target)
    log(f"drafter seqkd done: {sinfo}")

    # ---- drafter with another tokenizer
    other = make_model(tok2, DRAFTER_SHAPE, args.seed + 2)
    vb2 = val_batches(tok2, val_docs, args.seq_len, args.seed)
    oinfo = train_loop("othertok", other, Batches(tok2, train_docs, args.seq_len, args.batch, args.seed + 2),
                       args.othertok_minutes, 3e-3, plain_loss)
    oinfo.update(common, lr=3e-3, val=val_metrics(other, *vb2))
    log(f"othertok done: {oinfo}")
    return dict(target=target, drafter=drafter, other=other, tinfo=tinfo, dinfo=dinfo, sinfo=sinfo, oinfo=oinfo)


def measure_costs(args, target, drafter, other) -> tuple[dict, dict, int]:
    """The cost of one decode step (fp32, single thread, cached, prompt of 512): milliseconds and
    FLOPs per token of each model, and the early exit's FLOPs per token."""
    torch.set_num_threads(1)
    for m in (target, drafter, other):
        m.float().eval()
    ms = {n: decode_step_ms(m) for n, m in (("target", target), ("drafter", drafter), ("othertok", other))}
    fl = {n: flops_per_token(m) for n, m in (("target", target), ("drafter", drafter), ("othertok", other))}
    exit_flops = 2 * (EARLY_EXIT_LAYER * sum(p.numel() for p in target.model.layers[0].parameters())
                      + target.lm_head.weight.numel())
    log(f"decode step ms {ms}; flops/token {fl}; early-exit flops {exit_flops}")
    torch.set_num_threads(args.threads)
    return ms, fl, exit_flops


def save_with_cards(out: Path, tok, tok2, trained: dict, ms: dict, fl: dict, exit_flops: int) -> None:
    """Each model saved under ``out`` with its model card (training facts, cost per token, its section)."""
    target, drafter, other = trained["target"], trained["drafter"], trained["other"]
    tinfo, dinfo, sinfo, oinfo = trained["tinfo"], trained["dinfo"], trained["sinfo"], trained["oinfo"]

    def cost_lines(name):
        return [
            "", "## Cost per token", "",
            f"- FLOPs per decode step ≈ 2 × (non-embedding weights + LM head) = {fl[name]:,}"
            + ("" if name == "target" else f" ({fl[name] / fl['target']:.3f} of the target's {fl['target']:,})"),
            f"- measured cached decode step (fp32, 1 thread, 512-token context, median): {ms[name]:.2f} ms"
            + ("" if name == "target" else f" ({ms[name] / ms['target']:.3f} of the target's {ms['target']:.2f} ms)"),
        ]

    tcard = card("specbatch demo target (LayerSkip early exit)", target, tinfo, cost_lines("target") + [
        "", "## Early exit (self-speculative decoding)", "",
        f"- trained with the LayerSkip-style loss `CE(final) + {EARLY_EXIT_WEIGHT} × CE(lm_head(norm(h_{EARLY_EXIT_LAYER})))`, "
        f"where `h_{EARLY_EXIT_LAYER}` is the output of decoder layer {EARLY_EXIT_LAYER} (1-based; "
        f"`output_hidden_states[{EARLY_EXIT_LAYER}]`).",
        f"- `config.early_exit_layer = {EARLY_EXIT_LAYER}`: run layers 1..{EARLY_EXIT_LAYER}, the final norm and the LM head to draft.",
        f"- early-exit FLOPs per token ≈ {exit_flops:,} ({exit_flops / fl['target']:.3f} of the full model)",
        f"- held-out top-1 agreement of the early exit with the full model: {tinfo['val']['val_top1_agreement_exit_vs_full']:.3f}",
        "", "## Drafters", "",
        "- `../demo-drafter`: same tokenizer, distilled from this model.",
        "- `../demo-drafter-othertok`: different tokenizer (universal assisted decoding).",
    ])
    save(target, tok, out / "demo-target", tcard)
    dcard = card("specbatch demo drafter (same tokenizer as demo-target)", drafter, dinfo, cost_lines("drafter") + [
        "", "## Training objective", "",
        "0.5 × cross-entropy on the text + 0.5 × KL(target ‖ drafter) on the next-token distribution of "
        "`demo-target` (distillation), so the drafter's greedy choices follow the target's.",
        f"- held-out top-1 agreement with the target: {dinfo['val']['val_top1_agreement_with_target']:.3f}",
    ] + seqkd_card_lines(sinfo))
    save(drafter, tok, out / "demo-drafter", dcard)
    ocard = card("specbatch demo drafter with a different tokenizer", other, oinfo, cost_lines("othertok") + [
        "", "## Tokenizer", "",
        f"Byte-level BPE with {len(tok2)} tokens and single-digit pre-splitting, trained on the same text: "
        f"it does not share a vocabulary with `demo-target` ({len(tok)} tokens), so pairing them needs universal "
        "assisted decoding (re-tokenizing text between the two). Trained with plain cross-entropy (no distillation).",
    ])
    save(other, tok2, out / "demo-drafter-othertok", ocard)


def main(argv=None):
    """Parse the flags; then the seqkd stage alone, or: corpus, tokenizers, the three trainings,
    their costs, the checkpoints with their cards and ``training_summary.json``."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    t_start = time.time()
    if args.stage == "seqkd":
        return seqkd_only(args, out)
    train_docs, val_docs, stats = load_corpus(Path(args.data), args.seed)
    log(f"corpus: {len(train_docs)} train docs, {len(val_docs)} held-out docs ({stats})")

    tok = train_tokenizer(train_docs, args.vocab, split_digits=False, seed=args.seed)
    tok2 = train_tokenizer(train_docs, args.other_vocab, split_digits=True, seed=args.seed + 1)
    log(f"tokenizers: {len(tok)} and {len(tok2)} tokens ({time.time() - t_start:.0f}s)")
    trained = train_models(args, tok, tok2, train_docs, val_docs)
    target, drafter, other = trained["target"], trained["drafter"], trained["other"]
    ms, fl, exit_flops = measure_costs(args, target, drafter, other)
    save_with_cards(out, tok, tok2, trained, ms, fl, exit_flops)
    summary = {"seconds_total": time.time() - t_start, "target": trained["tinfo"], "drafter": trained["dinfo"],
               "drafter_seqkd": trained["sinfo"], "othertok": trained["oinfo"],
               "decode_step_ms": ms, "flops_per_token": fl, "early_exit_flops": exit_flops,
               "params": {n: count_params(m) for n, m in (("target", target), ("drafter", drafter), ("othertok", other))}}
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2, default=float))
    log(f"all done in {(time.time() - t_start) / 60:.1f} min -> {out}")

if __name__ == "__main__":
    sys.exit(main())
