"""Train an EAGLE draft head for SmolLM2-135M-Instruct on CPU (``models/smollm2-135m-eagle``).

Run from the repository root, after ``python scripts/fetch_models.py``::

    python train/train_smollm2_draft_head.py                  # the shipped run (<= 90 min on 2 threads)
    python train/train_smollm2_draft_head.py --resume         # continue a killed run (also automatic)
    python train/train_smollm2_draft_head.py --target /tmp/tiny --out /tmp/head --work /tmp/work \\
        --gen-minutes 0.1 --news-minutes 0.05 --train-minutes 0.1 --eval-rows 2 --smoke   # smoke run

The head is the ``eagle`` proposer's (:mod:`pipeline.engine.draft_head`; the training step:
:mod:`train.draft_head_training`): the target's
feature of position ``j`` and the embedding of ``x_{j+1}`` -> one Llama decoder layer ->
``x_{j+2}`` over a reduced draft vocabulary, chained on its own output for later draft
positions (EAGLE, Li et al. 2024; EAGLE-3, 2025; DeepSeek-V3's MTP layout; FR-Spec's
frequency-ranked vocabulary, Zhao et al. 2025).

Stages (each cached under ``--work``; a killed run resumes at the stage and shard it
reached, a finished stage is never redone unless ``--fresh``):

1. **answers** (``--gen-minutes``): the target's own greedy answers (at most
   ``--max-new-tokens``) to summarization prompts formatted exactly as the default job formats
   them for this model (``pipeline.prompts.PromptBuilder`` with the default summarize task:
   the default template inside SmolLM2's chat template) -- XSum articles 264-999 of
   ``../shared/data/xsum_helm_1000`` (at most ``--max-prompt`` tokens) interleaved with short
   English news articles (consecutive sentences of WMT newstest2014/2016, TICO-19 and FLORES
   devtest, grouped into 60-160-word paragraphs like the default job's inputs).  Generated
   by this repo's :class:`ModelRunner` (slot cache, rows in flight refilled as they finish,
   the engine's CPU kernels), float32; every pass keeps the target's hidden states of the
   stored layers and its top-``--top-k`` next-token log-probabilities at every position.
2. **news** (``--news-minutes``): one target pass over 256-token chunks of plain English news
   text (the same corpora), keeping the same.
3. **heldout**: the same as 1 for XSum articles 0..``--eval-rows``-1 (the report set).
   **XSum articles 0-263 are never trained on**: 0-199 are the report set, 200-263 the
   benchmark set.
4. **vocab**: the draft vocabulary -- target ids ranked by how often the target's argmax
   names them in the training data (answers weighted ``--answer-weight``); the coverage of
   the target's argmax on the held-out answers by the top ``N``, for the card.
5. **train** (``--train-minutes``): AdamW on the head (the target frozen; its embeddings
   shared).  Loss per draft position ``s = 1 .. --unroll`` (training-time test: step ``s``
   fed its own step ``s - 1`` output, with the attention each draft position sees at
   inference, ``train.draft_head_training.unrolled``), weighted ``--step-decay`` ** (s-1): cross-entropy
   against the target's top-k distribution renormalized over the draft vocabulary, answer
   positions weighted ``--answer-weight``, other positions sampled with probability
   ``--prompt-fraction`` (the output layer runs only on those); plus
   ``--regression-weight`` x smooth-L1 of the normed output feature ``RMSNorm(g_j)`` against
   the target's final normed hidden state at ``j + 1`` (EAGLE-1's feature regression: a dense
   target, and the one whose image under the tied output layer is the target's own logits).  Checkpointed every ``--save-every`` seconds.
6. **eval**: top-1 agreement with the target per draft position on the held-out answers;
   the engine's ``eagle`` method against plain decoding (greedy, ``k = 1..4``, float32, 1
   thread) on the held-out prompts -- every output must be identical -- with acceptance
   rate, mean accepted length and acceptance per position; the cost ratio ``c`` (a head
   draft step / a target decode step, 1 and 8 rows, float32, 1 thread, median).
7. **card**: the checkpoint (bfloat16) in ``--out`` with ``README.md`` and
   ``training_summary.json``.

Every stage runs for a wall-clock budget, so its figures depend on the machine's load (the
card records the load average).
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

from train.draft_head_training import (Data, init_head, lr_scale, make_batch, make_optimizer,  # noqa: E402
                                      record, topk_logprobs, train_step, unrolled)
from train.state_files import load_state, refuse_pickled, save_state  # noqa: E402

DATA = REPO.parent / "shared" / "data"
#: XSum articles 0..199 are the report set, 200..263 the benchmark set: never trained on
FIRST_TRAIN_XSUM = 264


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- text sources
def load_xsum(data: Path) -> list[dict]:
    """The XSum articles (:func:`pipeline.corpora.xsum_rows`, HELM's wrapper stripped) as
    ``{"text", "summary"}``, in file order."""
    from pipeline.corpora import xsum_rows

    return [{"text": r["text"], "summary": r["reference"].strip()} for r in xsum_rows(data)]


def news_documents(data: Path) -> list[list[str]]:
    """English news as documents (lists of consecutive sentences): WMT newstest (one
    document per run of lines), TICO-19, FLORES devtest (grouped by article URL)."""
    docs: list[list[str]] = []
    for name in ("wmt_newstest/eng-deu.newstest2014.eng", "wmt_newstest/eng-ron.newstest2016.eng",
                 "tico19_test/en-fr.tico19-test.en"):
        p = data / name
        if p.exists():
            lines = [x.strip() for x in p.read_text(encoding="utf-8").splitlines() if x.strip()]
            docs += [lines[i : i + 40] for i in range(0, len(lines), 40)]
    flores = data / "flores200_devtest"
    if (flores / "eng_Latn.devtest").exists():
        sents = (flores / "eng_Latn.devtest").read_text(encoding="utf-8").splitlines()
        urls = [line.split("\t")[0] for line in (flores / "metadata_devtest.tsv").read_text().splitlines()[1:]]
        by_url: dict[str, list[str]] = {}
        for u, s in zip(urls, sents):
            by_url.setdefault(u, []).append(s.strip())
        docs += list(by_url.values())
    return docs


def news_paragraphs(docs: list[list[str]], seed: int) -> list[str]:
    """Short articles of 60-160 words from consecutive sentences (the default job's inputs
    are paragraphs like these)."""
    rng = random.Random(seed)
    out = []
    for doc in docs:
        i = 0
        while i < len(doc):
            goal, words, para = rng.randint(60, 160), 0, []
            while i < len(doc) and words < goal:
                para.append(doc[i])
                words += len(doc[i].split())
                i += 1
            if words >= 40:
                out.append(" ".join(para))
    rng.shuffle(out)
    return out


# ----------------------------------------------------------------------------- records
class Shards:
    """Records in numbered safetensors + JSON files under ``folder`` (:mod:`train.state_files`,
    written atomically; never a pickle), with a ``done`` marker once the stage is complete.

    Raises (on construction):
        StateFileError: ``folder`` holds shards an older version pickled (``shard-*.pt``),
            named and never loaded.
    """

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        refuse_pickled(folder, sorted(p.name for p in folder.glob("shard-*.pt")))

    def files(self) -> list[Path]:
        return sorted(self.folder.glob("shard-*.safetensors"))

    def write(self, records: list[dict], meta: dict) -> None:
        n = len(self.files())
        save_state(self.folder / f"shard-{n:05d}.safetensors", {"records": records, "meta": meta})

    def meta(self) -> list[dict]:
        return [load_state(f)["meta"] for f in self.files()]

    def load(self) -> list[dict]:
        out = []
        for f in self.files():
            out += load_state(f)["records"]
        return out

    @property
    def done(self) -> bool:
        return (self.folder / "done").exists()

    def finish(self, info: dict) -> None:
        (self.folder / "done").write_text(json.dumps(info))

    def info(self) -> dict:
        return json.loads((self.folder / "done").read_text())


@torch.inference_mode()
def generate_with_features(target, prompts: list[list[int]], layers: list[int], max_new: int, top_k: int, rows: int,
                           deadline: float, on_records, flush_every: int = 8, eos=None) -> int:
    """The target's greedy answers to ``prompts`` (in order) with ``rows`` rows in flight,
    keeping features and top-k of every position; calls ``on_records(records, next_index)``
    every ``flush_every`` finished rows (in prompt order) and at the end.  Stops admitting
    new prompts at ``deadline`` (``time.time()``).  Returns how many prompts were finished."""
    from pipeline.engine.cpu import prepare
    from pipeline.engine.runner import ModelRunner

    prepare(target, None, "target")  # the engine's CPU kernels and lean pass, as a job's target (once)
    runner = ModelRunner(target, rows)
    runner.cache.reserve(max(len(p) for p in prompts) + max_new + 1 if prompts else 64)
    eos_ids = set([eos] if isinstance(eos, int) else (eos or []))
    free = list(range(rows))
    live: dict[int, dict] = {}  # slot -> state
    finished: dict[int, dict] = {}
    next_prompt, next_flush = 0, 0

    def admit(slot: int, index: int) -> None:
        ids = prompts[index]
        out = runner.forward([slot], [torch.tensor(ids)], [0], logits_to_keep=len(ids), output_hidden_states=layers)
        feats = torch.stack([out.hidden_states[i][0] for i in layers], dim=1).to(torch.bfloat16)  # (P, m, H)
        v, i = topk_logprobs(out.logits[0], top_k)
        live[slot] = {"index": index, "ids": list(ids), "feats": [feats], "v": [v], "i": [i],
                      "next": int(i[-1, 0]), "prompt_len": len(ids)}

    def close(slot: int) -> None:
        st = live.pop(slot)
        ids = st["ids"] + [st["next"]]
        feats, v, i = torch.cat(st["feats"]), torch.cat(st["v"]), torch.cat(st["i"])
        finished[st["index"]] = record(ids, st["prompt_len"], feats, v, i, "answer")
        free.append(slot)

    def flush(final: bool = False) -> None:
        nonlocal next_flush
        batch = []
        while next_flush in finished:
            batch.append(finished.pop(next_flush))
            next_flush += 1
        if batch:
            on_records(batch, next_flush)

    while True:
        while free and next_prompt < len(prompts) and time.time() < deadline:
            admit(free.pop(), next_prompt)
            next_prompt += 1
        if not live:
            break
        slots = sorted(live)
        for s in list(slots):  # answers that end here: EOS or the budget
            st = live[s]
            if st["next"] in eos_ids or len(st["ids"]) + 1 - st["prompt_len"] >= max_new:
                close(s)
        slots = sorted(live)
        if slots:
            tokens = [torch.tensor([live[s]["next"]]) for s in slots]
            starts = [len(live[s]["ids"]) for s in slots]
            out = runner.forward(slots, tokens, starts, logits_to_keep=1, output_hidden_states=layers)
            feats = torch.stack([out.hidden_states[i][:, -1] for i in layers], dim=1).to(torch.bfloat16)  # (b, m, H)
            v, i = topk_logprobs(out.logits[:, -1], top_k)
            for b, s in enumerate(slots):
                st = live[s]
                st["ids"].append(st["next"])
                st["feats"].append(feats[b : b + 1])
                st["v"].append(v[b : b + 1])
                st["i"].append(i[b : b + 1])
                st["next"] = int(i[b, 0])
        if len(finished) >= flush_every:
            flush()
    flush(final=True)
    return next_flush


@torch.inference_mode()
def chunk_features(target, chunks: list[list[int]], layers: list[int], top_k: int, deadline: float, on_records,
                   batch: int = 4) -> int:
    """One target pass per batch of equal-length chunks; records of plain text."""
    done = 0
    for b in range(0, len(chunks), batch):
        if time.time() > deadline:
            break
        part = chunks[b : b + batch]
        out = target(input_ids=torch.tensor(part), output_hidden_states=layers)
        recs = []
        for r, ids in enumerate(part):
            feats = torch.stack([out.hidden_states[i][r, :-1] for i in layers], dim=1).to(torch.bfloat16)
            v, i = topk_logprobs(out.logits[r, :-1], top_k)
            recs.append(record(ids, len(ids), feats, v, i, "news"))
        done = b + len(part)
        on_records(recs, done)
    return done


# ----------------------------------------------------------------------------- data for the head
def draft_vocab_order(records: list[dict], vocab: int, answer_weight: float,
                      text_counts: torch.Tensor | None = None) -> torch.Tensor:
    """Target ids, most frequent first: the share of the target's argmax naming each id in
    ``records`` (answer positions weighted ``answer_weight``) plus, when given, its share of
    the tokens of the training texts (``text_counts``, far more text than the target ran on:
    a steadier ranking of the rarer ids); ids never seen follow in id order."""
    counts = torch.zeros(vocab, dtype=torch.float64)
    for r in records:
        top1 = r["topi"][:, 0].long()
        w = torch.ones(top1.shape[0], dtype=torch.float64)
        w[max(0, r["prompt_len"] - 1):] = answer_weight
        counts.index_add_(0, top1, w)
    counts = counts / counts.sum().clamp_min(1)
    if text_counts is not None:
        counts = counts + text_counts / text_counts.sum().clamp_min(1)
    return torch.argsort(-counts, stable=True)


def text_token_counts(tokenizer, texts: list[str], vocab: int) -> torch.Tensor:
    """``(vocab,)`` how often each id occurs in the tokenized ``texts``."""
    counts = torch.zeros(vocab, dtype=torch.float64)
    for t in texts:
        ids = torch.tensor(tokenizer(t, add_special_tokens=False)["input_ids"], dtype=torch.long)
        if ids.numel():
            counts.index_add_(0, ids.clamp_max(vocab - 1), torch.ones(ids.numel(), dtype=torch.float64))
    return counts


def coverage(records: list[dict], order: torch.Tensor, sizes: list[int]) -> dict[int, float]:
    """Fraction of the target's argmax tokens on the answer positions of ``records`` that
    lie in the first ``n`` ids of ``order``, per ``n``."""
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel())
    ranks = torch.cat([rank[r["topi"][max(0, r["prompt_len"] - 1):, 0].long()] for r in records])
    return {n: round(float((ranks < n).float().mean()), 4) for n in sizes}


def train_head(head, train: Data, args, work: Path, vocab_index: torch.Tensor) -> dict:
    """AdamW with warm-up and cosine decay for ``--train-minutes`` of wall time (resumable
    from ``work/train-state.safetensors``, safetensors + JSON: never a pickle).

    Raises:
        StateFileError: the saved state is not safetensors + JSON (an older version's pickled
            ``train-state.pt`` included), named and never loaded.
    """
    opt, params = make_optimizer(head, args.lr)
    state_file = work / "train-state.safetensors"
    refuse_pickled(work, ("train-state.pt",))
    st = {"step": 0, "elapsed": 0.0, "tokens": 0, "losses": [], "agree": []}
    if state_file.exists():
        saved = load_state(state_file)
        head.load_state_dict(saved["head"], strict=False)
        opt.load_state_dict(saved["opt"])
        st = saved["stats"]
        log(f"  resumed training at step {st['step']} ({st['elapsed']:.0f} s done)")
    budget = args.train_minutes * 60
    rng = random.Random(args.seed + st["step"])
    layers = head.head_config.feature_layers
    recs = [r for r in train.records if r["ids"].shape[0] > 3]
    head.train()
    t0, last_save = time.time() - st["elapsed"], time.time()
    warm = min(60.0, budget * 0.05)
    order: list[int] = []
    max_steps = args.train_steps
    while (time.time() - t0 < budget) if max_steps is None else (st["step"] < max_steps):
        elapsed = time.time() - t0
        if max_steps is None:  # warm-up then cosine decay to 10 % over the time budget
            frac, warmup = min(1.0, elapsed / budget), min(1.0, (elapsed + 1) / warm)
        else:  # the same over a fixed number of steps (comparisons at equal steps)
            frac, warmup = st["step"] / max_steps, min(1.0, (st["step"] + 1) / max(1, max_steps // 20))
        scale = lr_scale(frac, warmup)
        batch_recs, n_tok = [], 0
        while n_tok < args.tokens_per_step:
            if not order:
                order = list(range(len(recs)))
                rng.shuffle(order)
            r = recs[order.pop()]
            batch_recs.append(r)
            n_tok += min(args.max_len, r["ids"].shape[0])
        batch = make_batch(train, batch_recs, head, layers, args.max_len, rng, args.prompt_fraction,
                           args.answer_weight, args.unroll, vocab_index)
        loss, agree = train_step(head, opt, params, batch, args.unroll, args.step_decay, args.regression_weight,
                                 args.autocast, args.lr * scale)
        st["step"] += 1
        st["tokens"] += int(batch["valid"].sum())
        st["losses"].append(loss)
        st["agree"].append(agree)
        if st["step"] % 10 == 0:
            a = [statistics.mean(x[s] for x in st["agree"][-10:] if not math.isnan(x[s])) for s in range(args.unroll)]
            log(f"  step {st['step']} tokens {st['tokens']} loss {statistics.mean(st['losses'][-10:]):.3f} "
                f"top1 {[round(x, 3) for x in a]} lr {args.lr * scale:.2e} ({time.time() - t0:.0f} s)")
        if time.time() - last_save > args.save_every:
            st["elapsed"] = time.time() - t0
            _save_state(state_file, head, opt, st)
            last_save = time.time()
    st["elapsed"] = time.time() - t0
    _save_state(state_file, head, opt, st)
    head.eval()
    tail = st["losses"][-20:]
    return {"steps": st["step"], "head_positions": st["tokens"], "seconds": round(st["elapsed"], 1),
            "final_loss": round(statistics.mean(tail), 4) if tail else None,
            "passes": round(st["tokens"] / max(1, sum(max(0, r["ids"].shape[0] - 2) for r in recs)), 2)}


def _save_state(path: Path, head, opt, st) -> None:
    save_state(path, {"head": head.state_dict(), "opt": opt.state_dict(), "stats": st})


# ----------------------------------------------------------------------------- evaluation
@torch.no_grad()
def agreement_by_position(head, data: Data, steps: int, answers_only: bool = True) -> list[float]:
    """Top-1 agreement of the head with the target's argmax at draft positions ``1 .. steps``
    (training-time-test forward, float32) on ``data``'s answer positions."""
    hits, counts = [0] * steps, [0] * steps
    layers = head.head_config.feature_layers
    for r in data.records:
        n = r["ids"].shape[0] - 2
        if n <= steps:
            continue
        feats = {k: v.unsqueeze(0) for k, v in data.feature(r, layers, 0, n).items()}
        p = head.project(feats)
        e = head.embed(r["ids"][1 : n + 1].long().unsqueeze(0))
        outs = unrolled(head, p, e, steps)
        top1 = r["topi"][1 : n + 1, 0].long()
        j = torch.arange(n)
        for s, g in enumerate(outs):
            m = j >= s
            if answers_only:
                m &= j + 1 >= r["prompt_len"] - 1
            pred = head.draft_vocab[head.logits(g[0]).argmax(-1)]
            hits[s] += int((pred == top1)[m].sum())
            counts[s] += int(m.sum())
    return [round(h / max(1, c), 4) for h, c in zip(hits, counts)]


def _stats(plain, res, cpu: float, plain_s: float) -> dict:
    k = max((len(r.stats.drafted_per_position) for r in res), default=0)
    drafted = sum(r.stats.draft_tokens for r in res)
    accepted = sum(r.stats.accepted_tokens for r in res)
    steps = sum(r.stats.verify_steps for r in res)
    new = sum(r.stats.new_tokens for r in res)
    dpp = [sum(r.stats.drafted_per_position[i] for r in res if len(r.stats.drafted_per_position) > i) for i in range(k)]
    app = [sum(r.stats.accepted_per_position[i] for r in res if len(r.stats.accepted_per_position) > i) for i in range(k)]
    return {"identical_to_plain": sum(a.token_ids == b.token_ids for a, b in zip(plain, res)),
            "acceptance_rate": round(accepted / max(1, drafted), 4), "mean_accepted_length": round(new / max(1, steps), 3),
            "acceptance_by_position": [round(a / max(1, d), 4) for a, d in zip(app, dpp)],
            "draft_tokens": drafted, "cpu_s": round(cpu, 2), "speedup_cpu_clock": round(plain_s / max(cpu, 1e-9), 3)}


def engine_acceptance(target, head_path: Path, prompts: list[list[int]], ks: list[int], max_new: int,
                      rows: int, extra: list[tuple] = ()) -> dict:
    """Plain against ``eagle`` at each fixed ``k`` (greedy, float32, 1 thread, ``rows`` rows in
    flight, the process CPU clock): identical rows, acceptance rate, mean accepted length,
    acceptance per draft position, speed-up.  ``extra``: further runs ``(label, settings,
    drafter (a callable making it), draft_length)`` (``"auto"`` or ``"fixed"``), reported under ``other``."""
    from pipeline.engine import GenerationSettings, SpeculationSettings, SpeculativeEngine
    from pipeline.engine.draft_head import load_draft_head

    gs = GenerationSettings(max_new_tokens=max_new)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t = time.process_time()
        plain = SpeculativeEngine(target, max_batch_size=rows).generate_batch(prompts, gs)
        plain_s = time.process_time() - t
        out = {"rows": len(prompts), "max_new_tokens": max_new, "rows_in_flight": rows,
               "plain_cpu_s": round(plain_s, 2), "by_k": {}, "other": {}}
        runs = [(k, SpeculationSettings(method="eagle", num_assistant_tokens=k), lambda: load_draft_head(head_path, target),
                 "fixed") for k in ks] + list(extra)
        for label, spec, drafter, draft_length in runs:
            engine = SpeculativeEngine(target, spec, drafter=drafter(), max_batch_size=rows, draft_length=draft_length)
            t = time.process_time()
            res = engine.generate_batch(prompts, gs)
            row = _stats(plain, res, time.process_time() - t, plain_s)
            (out["by_k"] if isinstance(label, int) else out["other"])[label] = row
            log(f"  {'eagle k=' if isinstance(label, int) else ''}{label}: {row}")
    finally:
        torch.set_num_threads(threads)
    return out


@torch.inference_mode()
def cost_ratio(target, head_path: Path, prompt: list[int], rows_list=(1, 8), reps: int = 15,
               draft_vocab_size: int | None = None) -> dict:
    """``c`` = one head draft step (a chained one-token pass + its output layer, every row) /
    one target decode step (one token per row, the same context), float32, 1 thread,
    medians of ``reps`` alternating measurements."""
    from pipeline.engine.cpu import prepare
    from pipeline.engine.draft_head import load_draft_head
    from pipeline.engine.proposers.eagle import EagleProposer
    from pipeline.engine.runner import ModelRunner

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {}
    try:
        for rows in rows_list:
            prepare(target, None, "target")  # as the engine prepares its models (once)
            runner = ModelRunner(target, rows)
            head = load_draft_head(head_path, target)
            prop = EagleProposer(target, head, draft_vocab_size)
            prepare(prop.head, None, "draft head")
            prop.bind(rows, runner)
            slots = list(range(rows))
            ids = torch.tensor(prompt)
            P = len(prompt)
            runner.cache.reserve(P + 2 * reps + 8)
            prop.runner.cache.reserve(P + 2 * reps + 8)
            for s in slots:  # the target's prefill (features 0 .. P-1), the head's catch-up over 0 .. P-2
                prop.admit([s], [ids.view(1, -1)])
                prop.target_forward(runner, [s], [ids], [0], 1)
                g = prop._pass([s], [prop.feats[s].get(0, P - 1)], [ids[1:P]], [0])
            g = g[:, -1].expand(rows, -1).contiguous()
            tok = torch.tensor([5])
            tt, th = [], []
            for r in range(reps):
                t0 = time.perf_counter()
                runner.forward(slots, [tok] * rows, [P + r] * rows, logits_to_keep=1)
                t1 = time.perf_counter()
                gg = prop._pass(slots, list(g.unsqueeze(1)), [tok] * rows, [P - 1 + r] * rows)[:, -1]
                head.logits(gg).argmax(-1)
                t2 = time.perf_counter()
                tt.append(t1 - t0)
                th.append(t2 - t1)
            t, h = statistics.median(tt), statistics.median(th)
            out[rows] = {"target_step_ms": round(t * 1e3, 2), "head_step_ms": round(h * 1e3, 2), "c": round(h / t, 4)}
            log(f"  cost at {rows} rows: {out[rows]}")
    finally:
        torch.set_num_threads(threads)
    return out


# ----------------------------------------------------------------------------- main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="models/cache/SmolLM2-135M-Instruct")
    ap.add_argument("--out", default="models/smollm2-135m-eagle")
    ap.add_argument("--work", default=None, help="stage cache (default: ~/.cache/specbatch/draft-head/<out name>)")
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--resume", action="store_true", help="continue the cached stages (the default; kept for clarity)")
    ap.add_argument("--fresh", action="store_true", help="discard the stage cache and start again")
    ap.add_argument("--gen-minutes", type=float, default=30)
    ap.add_argument("--news-minutes", type=float, default=5)
    ap.add_argument("--train-minutes", type=float, default=30)
    ap.add_argument("--eval-rows", type=int, default=16, help="held-out XSum articles 0..N-1")
    ap.add_argument("--eval-k", default="1,2,3,4")
    ap.add_argument("--eval-vocab-sizes", default="4096,8192", help="smaller draft vocabularies also evaluated")
    ap.add_argument("--eval-drafter", default="models/smollm2-135m-drafter",
                    help="a draft model evaluated with method draft_model, full and reduced vocabulary ('' skips)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=600)
    ap.add_argument("--rows", type=int, default=8, help="rows in flight while generating answers")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--store-layers", default="eagle3+last",
                    help="target hidden_states stored: 'eagle3+last' = 2, L/2, L-3 and L (the final normed state)")
    ap.add_argument("--feature-layers", default="eagle3",
                    help="'eagle3' (2, L/2, L-3), 'last' or comma-separated hidden_states indices")
    ap.add_argument("--draft-vocab", type=int, default=16384, help="N, the draft vocabulary size")
    ap.add_argument("--tie", action=argparse.BooleanOptionalAction, default=True,
                    help="output layer = the target's rows of the draft vocabulary (nothing stored)")
    ap.add_argument("--unroll", type=int, default=3, help="draft positions trained (training-time test)")
    ap.add_argument("--step-decay", type=float, default=0.8)
    ap.add_argument("--regression-weight", type=float, default=0.0)
    ap.add_argument("--answer-weight", type=float, default=4.0)
    ap.add_argument("--prompt-fraction", type=float, default=0.3)
    ap.add_argument("--max-len", type=int, default=384, help="head positions per training window")
    ap.add_argument("--tokens-per-step", type=int, default=1024)
    ap.add_argument("--init", choices=["identity", "target-layer", "random"], default="identity",
                    help="the decoder layer's warm start (see init_head)")
    ap.add_argument("--train-steps", type=int, default=None,
                    help="train this many steps instead of --train-minutes (comparisons at equal steps)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--save-every", type=float, default=120)
    ap.add_argument("--autocast", action=argparse.BooleanOptionalAction, default=True, help="bf16 autocast in training")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stop-after", choices=["data", "train"], default=None,
                    help="stop after the data stages (and the vocabulary coverage), or after training (ablations)")
    ap.add_argument("--run-name", default="run", help="the training stage's cache name (ablations)")
    ap.add_argument("--smoke", action="store_true", help="tiny target: no chat template needed, short evaluation")
    return ap.parse_args(argv)


def _layers(spec: str, n_layers: int) -> list[int]:
    eagle3 = sorted({2, n_layers // 2, n_layers - 3})
    if spec == "eagle3+last":
        return sorted(set(eagle3 + [n_layers]))
    if spec == "eagle3":
        return eagle3
    if spec == "last":
        return [n_layers]
    return [int(x) % (n_layers + 1) for x in spec.split(",")]


def setup(args):
    """The run's shared state: the directories (``--fresh`` empties the work directory), the
    frozen target and its tokenizer, the stored and feature layers, the XSum rows and the prompt
    builder, as a namespace; 2, after saying why on stderr, when there is no target checkpoint.

    Raises SystemExit when the feature layers or the last layer are not among the stored layers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.config import TaskConfig
    from pipeline.prompts import PromptBuilder

    load_before = os.getloadavg()
    target_dir = Path(args.target) if os.path.isabs(args.target) else REPO / args.target
    out_dir = Path(args.out) if os.path.isabs(args.out) else REPO / args.out
    work = Path(args.work) if args.work else Path.home() / ".cache" / "specbatch" / "draft-head" / out_dir.name
    if args.fresh and work.exists():
        import shutil

        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    if not (target_dir / "config.json").is_file():
        print(f"error: no target checkpoint at {target_dir}; run python scripts/fetch_models.py", file=sys.stderr)
        return 2
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    n_layers = target.config.num_hidden_layers
    stored = _layers(args.store_layers, n_layers)
    feature_layers = _layers(args.feature_layers, n_layers)
    if not set(feature_layers) | {n_layers} <= set(stored):
        raise SystemExit(f"--feature-layers {feature_layers} and the last layer {n_layers} (the regression target) "
                         f"must be among --store-layers {stored}")
    builder = PromptBuilder(tokenizer, TaskConfig())
    log(f"work dir {work}; stored layers {stored}; feature layers {feature_layers}; load {load_before}")

    def prompt_ids(text: str) -> list[int]:
        return list(builder.build(text)[1])

    data_dir = Path(args.data)
    return SimpleNamespace(args=args, load_before=load_before, target_dir=target_dir, out_dir=out_dir, work=work,
                           tokenizer=tokenizer, target=target, stored=stored, feature_layers=feature_layers,
                           eos=target.generation_config.eos_token_id, data_dir=data_dir, prompt_ids=prompt_ids,
                           xsum=load_xsum(data_dir), timeline={})


def stage_answers(run) -> Shards:
    """Stage 1: the target's answers to the training prompts (XSum interleaved with news), within
    ``--gen-minutes`` in all, resumed at the shard a killed run reached."""
    args, work = run.args, run.work
    gen = Shards(work / "answers")
    if not gen.done:
        rng = random.Random(args.seed)
        rows = run.xsum[FIRST_TRAIN_XSUM:]
        rng.shuffle(rows)
        xs = [p for p in (run.prompt_ids(r["text"]) for r in rows) if len(p) <= args.max_prompt]
        news = [run.prompt_ids(t) for t in news_paragraphs(news_documents(run.data_dir), args.seed)]
        prompts = []
        for i in range(max(len(xs), len(news))):  # interleaved: long XSum articles, short news articles
            prompts += ([xs[i]] if i < len(xs) else []) + ([news[i]] if i < len(news) else [])
        done = sum(m["count"] for m in gen.meta())
        spent = sum(m["seconds"] for m in gen.meta())
        log(f"stage answers: {len(xs)} XSum + {len(news)} news prompts; {done} done, {spent:.0f} s spent "
            f"(budget {args.gen_minutes} min)")
        t0 = time.time()
        deadline = t0 + args.gen_minutes * 60 - spent
        last = [t0]

        def on_records(recs, upto):
            gen.write(recs, {"count": len(recs), "seconds": time.time() - last[0]})
            last[0] = time.time()
            log(f"  answers: {done + upto} sequences, {sum(r['ids'].shape[0] - r['prompt_len'] for r in recs)} answer tokens in the last shard")

        generate_with_features(run.target, prompts[done:], run.stored, args.max_new_tokens, args.top_k, args.rows,
                               deadline, on_records, eos=run.eos)
        gen.finish({"seconds": spent + time.time() - t0})
    run.timeline["answers_s"] = round(gen.info()["seconds"], 1)
    return gen


def stage_news(run) -> Shards:
    """Stage 2: one target pass over 256-token chunks of plain news text, within ``--news-minutes``."""
    args = run.args
    news_sh = Shards(run.work / "news")
    if not news_sh.done:
        docs = news_documents(run.data_dir)
        random.Random(args.seed + 1).shuffle(docs)
        chunks, buf = [], []
        for doc in docs:
            for line in doc:
                buf += run.tokenizer(line + "\n", add_special_tokens=False)["input_ids"]
                if len(buf) >= 256:
                    chunks.append(buf[:256])
                    buf = []
        done = sum(m["count"] for m in news_sh.meta())
        spent = sum(m["seconds"] for m in news_sh.meta())
        log(f"stage news: {len(chunks)} chunks of 256 tokens; {done} done (budget {args.news_minutes} min)")
        t0 = time.time()
        last = [t0]

        def on_news(recs, upto):
            news_sh.write(recs, {"count": len(recs), "seconds": time.time() - last[0]})
            last[0] = time.time()

        chunk_features(run.target, chunks[done:], run.stored, args.top_k, t0 + args.news_minutes * 60 - spent, on_news)
        news_sh.finish({"seconds": spent + time.time() - t0})
    run.timeline["news_s"] = round(news_sh.info()["seconds"], 1)
    return news_sh


def stage_heldout(run) -> tuple[Shards, list[list[int]]]:
    """Stage 3: the target's answers to XSum articles 0..eval_rows-1 (prompts of at most 800
    tokens); the shards and those prompts."""
    args = run.args
    held_sh = Shards(run.work / "heldout")
    held_prompts = [run.prompt_ids(r["text"]) for r in run.xsum[: args.eval_rows]]
    held_prompts = [p for p in held_prompts if len(p) <= 800]
    if not held_sh.done:
        log(f"stage heldout: {len(held_prompts)} XSum articles 0..{args.eval_rows - 1}")
        t0 = time.time()
        held_recs: list = []
        generate_with_features(run.target, held_prompts, run.stored, args.max_new_tokens, args.top_k, args.rows,
                               float("inf"), lambda recs, upto: held_recs.extend(recs), eos=run.eos)
        held_sh.write(held_recs, {"count": len(held_recs), "seconds": time.time() - t0})
        held_sh.finish({"seconds": time.time() - t0})
    run.timeline["heldout_s"] = round(held_sh.info()["seconds"], 1)
    return held_sh, held_prompts


def training_data(run, gen: Shards, news_sh: Shards, held_sh: Shards) -> SimpleNamespace:
    """The cached stages as training and held-out :class:`Data`, the answer records and the data's counts."""
    train_recs = gen.load() + news_sh.load()
    held = Data(held_sh.load(), run.stored)
    train = Data(train_recs, run.stored)
    answers = [r for r in train_recs if r["kind"] == "answer"]
    data_stats = {
        "answer_sequences": len(answers),
        "answer_tokens": sum(r["ids"].shape[0] - r["prompt_len"] for r in answers),
        "prompt_tokens": sum(r["prompt_len"] for r in answers),
        "news_chunks": len(train_recs) - len(answers), "tokens": sum(r["ids"].shape[0] for r in train_recs),
        "heldout_sequences": len(held.records),
    }
    log(f"data: {data_stats}")
    return SimpleNamespace(train_recs=train_recs, held=held, train=train, answers=answers, stats=data_stats)


def stage_vocab(run, data: SimpleNamespace) -> SimpleNamespace:
    """Stage 4: the draft vocabulary's order, its size N, and the coverage of the target's argmax
    by the top N (held-out and training answers), also written to ``<work>/coverage.json``."""
    args, xsum = run.args, run.xsum
    V = run.target.config.vocab_size
    texts = [r["text"] for r in xsum[FIRST_TRAIN_XSUM:]] + [r["summary"] for r in xsum[FIRST_TRAIN_XSUM:]]
    texts += [" ".join(d) for d in news_documents(run.data_dir)]
    text_counts = text_token_counts(run.tokenizer, texts, V)
    order = draft_vocab_order(data.train_recs, V, args.answer_weight, text_counts)
    data.stats["vocab_text_tokens"] = int(text_counts.sum())
    sizes = [n for n in (1024, 2048, 4096, 8192, 12288, 16384, 24576, 32768, V) if n <= V]
    cov = coverage(data.held.records, order, sizes)
    cov_train = coverage(data.answers, order, sizes)
    log(f"coverage of the target's argmax on held-out answers by the top N: {cov}")
    N = min(args.draft_vocab, V)
    (run.work / "coverage.json").write_text(json.dumps({"heldout_answers": cov, "train_answers": cov_train,
                                                        "data": data.stats}))
    return SimpleNamespace(V=V, order=order, N=N, cov=cov, cov_train=cov_train)


def stage_train(run, data: SimpleNamespace, vocab: SimpleNamespace) -> SimpleNamespace:
    """Stage 5: build the head (draft vocabulary, warm start), train it within ``--train-minutes``
    and measure its held-out top-1 agreement by draft position before and after; writes
    ``<work>/<run-name>/result.json``."""
    from pipeline.engine.draft_head import DraftHead, DraftHeadConfig

    args, target, feature_layers, N = run.args, run.target, run.feature_layers, vocab.N
    config = DraftHeadConfig.for_target(target, feature_layers=feature_layers, draft_vocab_size=N, tie_lm_head=args.tie)
    config.target = ("HuggingFaceTB/SmolLM2-135M-Instruct" if "SmolLM2-135M-Instruct" in str(run.target_dir)
                     else str(run.target_dir))
    head = DraftHead(config)
    head.set_draft_vocab(vocab.order[:N])
    init_head(head, target, args.init)
    head.attach(target)
    vocab_index = torch.full((vocab.V,), -1, dtype=torch.long)
    vocab_index[head.draft_vocab] = torch.arange(N)
    run_dir = run.work / args.run_name
    run_dir.mkdir(exist_ok=True)
    before = agreement_by_position(head, data.held, 4)
    log(f"stage train ({args.train_minutes} min): {sum(p.numel() for p in head.parameters() if p.requires_grad) / 1e6:.2f} M "
        f"trainable parameters; held-out top-1 by position before {before}")
    train_stats = train_head(head, data.train, args, run_dir, vocab_index)
    after = agreement_by_position(head, data.held, 4)
    after_all = agreement_by_position(head, data.held, 4, answers_only=False)
    log(f"  held-out top-1 agreement by draft position: answers {after}, all positions {after_all}")
    result = {"args": vars(args), "feature_layers": feature_layers, "draft_vocab_size": N, "tie": args.tie,
              "training": train_stats, "heldout_top1_before": before, "heldout_top1_answers": after,
              "heldout_top1_all": after_all}
    (run_dir / "result.json").write_text(json.dumps(result, indent=2))
    return SimpleNamespace(config=config, head=head, stats=train_stats, before=before, after=after,
                           after_all=after_all)


def stage_eval(run, held_prompts: list[list[int]], N: int) -> tuple[dict, dict, dict]:
    """Stage 6 on the saved checkpoint, loaded as the job loads it (float32): the engine's
    acceptance (``eagle`` at each ``--eval-k``, reduced vocabularies, the engine's own draft
    length, ``--eval-drafter`` with ``draft_model``) and the cost ratio c, overall and per
    reduced vocabulary size."""
    from transformers import AutoModelForCausalLM

    from pipeline.engine import SpeculationSettings
    from pipeline.engine.draft_head import load_draft_head

    args, target, out_dir = run.args, run.target, run.out_dir
    ks = [int(k) for k in args.eval_k.split(",")]
    eval_prompts = held_prompts[: args.eval_rows]

    def head_loader():
        return load_draft_head(out_dir, target)

    sizes = [n for n in (int(x) for x in args.eval_vocab_sizes.split(",") if x) if n < N]
    k_sweep = max(ks)
    extra = [(f"eagle k={k_sweep}, N={n}", SpeculationSettings(method="eagle", num_assistant_tokens=k_sweep,
                                                               draft_vocab_size=n), head_loader, "fixed") for n in sizes]
    extra.append((f"eagle, the engine's draft-length controller (k <= {k_sweep})",
                  SpeculationSettings(method="eagle", num_assistant_tokens=k_sweep), head_loader, "auto"))
    drafter_dir = Path(args.eval_drafter) if os.path.isabs(args.eval_drafter) else REPO / args.eval_drafter
    if args.eval_drafter and (drafter_dir / "config.json").is_file():  # draft_model, full and reduced vocabulary
        drafter = AutoModelForCausalLM.from_pretrained(drafter_dir, dtype=torch.float32).eval()
        for n in [None] + sizes + [N]:
            kw = {} if n is None else {"draft_vocab": str(out_dir), "draft_vocab_size": n}
            extra.append(("draft_model k=2, " + ("full vocabulary" if n is None else f"N={n}"),
                          SpeculationSettings(method="draft_model", num_assistant_tokens=2, **kw), lambda: drafter, "fixed"))
    acc = engine_acceptance(target, out_dir, eval_prompts, ks, args.max_new_tokens, min(8, len(eval_prompts)), extra)
    cost_prompt = held_prompts[0]
    cost = cost_ratio(target, out_dir, cost_prompt, rows_list=(1, 8) if not args.smoke else (1, 2))
    cost_by_n = {n: cost_ratio(target, out_dir, cost_prompt, rows_list=(1, 8) if not args.smoke else (1,),
                               draft_vocab_size=n) for n in sizes}
    return acc, cost, cost_by_n


def write_card(run, data, vocab, trained, head, acc: dict, cost: dict, cost_by_n: dict, t_start: float) -> dict:
    """Stage 7: ``training_summary.json`` and the model card ``README.md`` in ``--out``; the summary."""
    args, target, out_dir, config = run.args, run.target, run.out_dir, trained.config
    size = sum(f.stat().st_size for f in out_dir.iterdir() if f.is_file())
    summary = {
        "target": config.target, "args": vars(args), "hidden_size": config.hidden_size, "stored_layers": run.stored,
        "feature_layers": run.feature_layers, "draft_vocab_size": vocab.N, "tie_lm_head": args.tie,
        "head_parameters": sum(p.numel() for n, p in head.named_parameters() if not (args.tie and n == "lm_head.weight")),
        "target_parameters": sum(p.numel() for p in target.parameters()),
        "data": data.stats, "coverage_heldout_answers": vocab.cov, "coverage_train_answers": vocab.cov_train,
        "training": trained.stats, "heldout_top1_before": trained.before, "heldout_top1_answers": trained.after,
        "heldout_top1_all": trained.after_all, "acceptance": acc, "cost": cost, "cost_by_draft_vocab_size": cost_by_n,
        "timeline": run.timeline,
        "ablations": ablations(run.work),
        "checkpoint_bytes": size, "wall_minutes": round((time.time() - t_start) / 60, 1),
        "load_average_before": [round(x, 2) for x in run.load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
        "torch": torch.__version__,
    }
    (out_dir / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out_dir / "README.md").write_text(model_card(summary))
    log(f"done in {summary['wall_minutes']} min this invocation: {out_dir} ({size / 1e6:.1f} MB)")
    return summary


def main(argv=None) -> int:
    """Stages 1-7 of the module's docstring; ``--stop-after`` ends after the data stages or training.
    0 when done, 2 when there is no target checkpoint."""
    args = parse_args(argv)
    from pipeline.engine.draft_head import load_draft_head, save_draft_head

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    t_start = time.time()
    run = setup(args)
    if isinstance(run, int):
        return run
    gen = stage_answers(run)  # 1. answers to training prompts
    news_sh = stage_news(run)  # 2. plain news text
    held_sh, held_prompts = stage_heldout(run)  # 3. held-out answers (XSum 0..eval_rows-1)
    data = training_data(run, gen, news_sh, held_sh)
    vocab = stage_vocab(run, data)  # 4. draft vocabulary
    if args.stop_after == "data":
        return 0
    trained = stage_train(run, data, vocab)  # 5. train
    if args.stop_after == "train":
        return 0

    # 6. save, then evaluate the saved checkpoint as the job loads it (float32)
    run.out_dir.mkdir(parents=True, exist_ok=True)
    trained.config.training = {"script": "train/train_smollm2_draft_head.py", "steps": trained.stats["steps"],
                               "heldout_top1_by_position": trained.after}
    save_draft_head(trained.head, run.out_dir)
    head = load_draft_head(run.out_dir, run.target)
    log("stage eval: engine acceptance (greedy, k = 1..4) and cost")
    t_eval = time.time()
    acc, cost, cost_by_n = stage_eval(run, held_prompts, vocab.N)
    run.timeline["train_s"] = trained.stats["seconds"]
    run.timeline["eval_s"] = round(time.time() - t_eval, 1)
    run.timeline["total_minutes"] = round(sum(v for k, v in run.timeline.items() if k.endswith("_s")) / 60, 1)
    write_card(run, data, vocab, trained, head, acc, cost, cost_by_n, t_start)  # 7. card
    return 0


def ablations(work: Path) -> list[dict]:
    """The equal-budget design runs (``--stop-after train --run-name abl-*``) found under
    ``work``: what each varied and its held-out top-1 agreement by draft position."""
    rows = []
    for f in sorted(work.glob("abl-*/result.json")):
        r = json.loads(f.read_text())
        a = r["args"]
        rows.append({"run": f.parent.name, "feature_layers": r["feature_layers"], "tie": r["tie"],
                     "unroll": a["unroll"], "regression_weight": a["regression_weight"], "init": a.get("init", "target-layer"),
                     "tokens_per_step": a["tokens_per_step"], "lr": a["lr"], "steps": r["training"]["steps"],
                     "top1_answers": r["heldout_top1_answers"], "top1_all": r["heldout_top1_all"]})
    return rows


INIT_TEXT = {
    "identity": "the decoder layer is a copy of the target's last layer with its attention and MLP output "
                "projections zeroed, so the head starts as the output layer on W_fc's mix",
    "target-layer": "the decoder layer is a copy of the target's last layer",
    "random": "transformers' initialisation",
}


def _card_about(s: dict) -> str:
    """The card's front matter, layout, data and training sections (up to the coverage line)."""
    a, d, t = s["args"], s["data"], s["training"]
    cov = s["coverage_heldout_answers"]
    cov_line = ", ".join(f"{n}: {v:.3f}" for n, v in cov.items())
    pos = ", ".join(f"{x:.3f}" for x in s["heldout_top1_answers"])
    pos_all = ", ".join(f"{x:.3f}" for x in s["heldout_top1_all"])
    head_kind = ("tied: the target's output-layer rows of the draft vocabulary, not stored" if s["tie_lm_head"]
                 else "its own, stored")
    return f"""---
license: apache-2.0
base_model: HuggingFaceTB/SmolLM2-135M-Instruct
pipeline_tag: text-generation
---

# smollm2-135m-eagle

An EAGLE draft head for speculative decoding with **SmolLM2-135M-Instruct** as the target (method
`eagle`: `models.drafter: models/smollm2-135m-eagle`), trained on CPU by
`train/train_smollm2_draft_head.py` (its docstring has the recipe). It reads the target's own hidden
states and embeddings; it is not a language model by itself and has no tokenizer.

| | |
| --- | --- |
| layout | z = W_fc [RMSNorm(p_j); RMSNorm(emb(x_(j+1)))] -> one Llama decoder layer (hidden {s['hidden_size']}, its own KV cache, RoPE) -> RMSNorm -> output layer over the draft vocabulary, predicting x_(j+2); chained on its own output feature for draft positions 2, 3, ... |
| features p_j | target `hidden_states` {s['feature_layers']} ({'the final, normed last hidden state' if len(s['feature_layers']) == 1 else 'concatenated, each RMS-normed, projected to ' + str(s['hidden_size'])}) |
| draft vocabulary | N = {s['draft_vocab_size']:,} target ids (`draft_vocab` in `model.safetensors`, most frequent first); q is zero outside; the target verifies over all 49,152 |
| output layer | {head_kind} |
| parameters | {s['head_parameters']:,} stored ({s['head_parameters'] / s['target_parameters']:.3f} of the target's {s['target_parameters']:,}); bfloat16; the folder is {s['checkpoint_bytes'] / 1e6:.1f} MB |
| target embeddings | shared at run time (frozen, never copied) |

## Data

**XSum articles 0-263 of `../shared/data/xsum_helm_1000` are in no training data** (0-199 are the report set,
200-263 the benchmark set); neither are Spec-Bench nor `data/demo_prompts.jsonl`.

- {d['answer_sequences']} summarization prompts formatted exactly as the default job formats them (the default
  template inside SmolLM2's chat template) with **the target's own greedy answers** ({d['answer_tokens']:,} answer
  tokens after {d['prompt_tokens']:,} prompt tokens): XSum articles 264-999 (at most {a['max_prompt']} prompt tokens)
  interleaved with short English news articles (WMT newstest2014/2016, TICO-19, FLORES devtest paragraphs);
- {d['news_chunks']} chunks of 256 tokens of plain English news text (the same corpora).

The target ran in float32 through this repo's `ModelRunner`; every pass kept its hidden states and top-{a['top_k']}
log-probabilities ({d['tokens']:,} tokens in all).

## Training

{t['steps']} AdamW steps (lr {a['lr']}, warm-up then cosine decay to 10 %), {t['head_positions']:,} head positions
({t['passes']} passes) in {t['seconds'] / 60:.1f} min, bf16 autocast, {a['threads']} threads; final loss {t['final_loss']}.
Loss: cross-entropy against the target's top-{a['top_k']} distribution renormalized over the draft vocabulary at draft
positions 1-{a['unroll']} (training-time test: each position fed the head's own previous output, with inference's
attention pattern), weighted {a['step_decay']}^(s-1); answer tokens weighted {a['answer_weight']}x, {a['prompt_fraction']:.0%} of
the other positions sampled; windows of {a['max_len']} positions. Warm start ({a.get('init', 'identity')}): {INIT_TEXT[a.get('init', 'identity')]}; the final
norm is the target's.

Held-out (the target's own answers to XSum articles 0-{a['eval_rows'] - 1}, float32), top-1 agreement with the target's
argmax by draft position 1-4: **{pos}** (answer tokens; all positions: {pos_all}). Before training: {', '.join(f'{x:.3f}' for x in s['heldout_top1_before'])}.

Coverage of the target's argmax on the held-out answers by the N most frequent ids: {cov_line}.

"""


def _card_results(s: dict) -> str:
    """The card's design measurements, acceptance, cost and run sections."""
    a, t, acc, cost = s["args"], s["training"], s["acceptance"], s["cost"]
    ks = sorted(acc["by_k"], key=int)
    acc_rows = "\n".join(
        f"| {k} | {acc['by_k'][k]['identical_to_plain']}/{acc['rows']} | {acc['by_k'][k]['acceptance_rate']:.3f} | "
        f"{acc['by_k'][k]['mean_accepted_length']:.2f} | {', '.join(f'{x:.2f}' for x in acc['by_k'][k]['acceptance_by_position'])} | "
        f"{acc['by_k'][k]['speedup_cpu_clock']:.2f}x |" for k in ks)
    cost_rows = "\n".join(f"| {s['draft_vocab_size']} | {r} | {c['target_step_ms']} | {c['head_step_ms']} | **{c['c']}** |"
                          for r, c in cost.items())
    for n, by_rows in s.get("cost_by_draft_vocab_size", {}).items():
        cost_rows += "\n" + "\n".join(f"| {n} | {r} | {c['target_step_ms']} | {c['head_step_ms']} | {c['c']} |"
                                      for r, c in by_rows.items())
    other_rows = "\n".join(f"| {label} | {r['identical_to_plain']}/{acc['rows']} | {r['acceptance_rate']:.3f} | "
                           f"{r['mean_accepted_length']:.2f} | {r['speedup_cpu_clock']:.2f}x |"
                           for label, r in acc.get("other", {}).items()) or "| (none) | | | | |"
    ablation_rows = "\n".join(
        f"| {r['run']} | {r['feature_layers']} | {'tied' if r['tie'] else 'own'} | {r['unroll']} | {r['regression_weight']} | "
        f"{r['init']} | {r['tokens_per_step']} x {r['steps']} | {', '.join(f'{x:.3f}' for x in r['top1_answers'])} "
        f"({', '.join(f'{x:.3f}' for x in r['top1_all'])}) |" for r in s.get("ablations", [])) or "| (none run) | | | | | | | |"
    return f"""## Design measurements

Short runs of the same script on the same cached data (`--stop-after train --run-name abl-*`), held-out top-1
agreement with the target by draft position 1-4 on the answer tokens (all positions in brackets):

| run | features | output layer | draft positions trained | feature regression | warm start | positions/step x steps | top-1 by position |
| --- | --- | --- | ---: | ---: | --- | ---: | --- |
{ablation_rows}

## Acceptance with the engine

Greedy, {acc['max_new_tokens']} new tokens, {acc['rows']} held-out XSum prompts (articles 0-{a['eval_rows'] - 1}),
{acc['rows_in_flight']} rows in flight, float32, 1 thread, the draft length fixed at k:

| k | identical to plain | acceptance rate | mean accepted length | acceptance by position | CPU-clock speed-up over plain |
| --- | ---: | ---: | ---: | --- | ---: |
{acc_rows}

(The speed-up column is one run on a shared machine, {acc['rows_in_flight']} rows in flight; `bench/bench_real.py` is the benchmark.)

Other runs on the same prompts (reduced draft vocabularies, the engine's own draft length, and the standalone
drafter `models/smollm2-135m-drafter` with method `draft_model`, whose LM head computes only the first N ids of
this head's `draft_vocab` with `method.draft_vocab: models/smollm2-135m-eagle` and `method.draft_vocab_size: N`):

| run | identical to plain | acceptance rate | mean accepted length | CPU-clock speed-up over plain |
| --- | ---: | ---: | ---: | ---: |
{other_rows}

## Cost

c = one head draft step (a one-token chained pass of the head + its output layer, every row) / one target decode
step (one token per row, after the same held-out prompt), float32, 1 thread, medians:

| draft vocabulary N | rows | target step (ms) | head step (ms) | c |
| ---: | ---: | ---: | ---: | ---: |
{cost_rows}

## Run

`python train/train_smollm2_draft_head.py`: {s['timeline']['total_minutes']} min of stages in all (answers
{s['timeline'].get('answers_s', 0) / 60:.1f} min, news {s['timeline'].get('news_s', 0) / 60:.1f} min, held-out
{s['timeline'].get('heldout_s', 0) / 60:.1f} min, training {t['seconds'] / 60:.1f} min, evaluation
{s['timeline']['eval_s'] / 60:.1f} min) on a {s['cpus']}-core machine shared with other jobs (load average before
{s['load_average_before']}, after {s['load_average_after']}); torch {s['torch']}. Figures: `training_summary.json`.

License: Apache-2.0, as the target.
"""


def model_card(s: dict) -> str:
    """The head's model card (``README.md``) from its training summary ``s``."""
    return _card_about(s) + _card_results(s)


if __name__ == "__main__":
    sys.exit(main())
