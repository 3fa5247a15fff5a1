"""Train, or continue training, the draft head of method ``eagle`` on a job's own outputs.

    python jobs/train_drafter.py --from out/summarize/date=2026-12-01 --output out/heads/2026-12-01
    python jobs/train_drafter.py --from out/summarize/date=2026-12-01 --head models/smollm2-135m-eagle --output out/heads/2026-12-01 --steps 40 --promote-to models/heads/current

Teacher-forced self-distillation (online speculative decoding, Liu et al. 2023; EAGLE's
recipe, Li et al. 2024, with EAGLE-3's training-time test): the job's committed rows are the
target's own answers, so one target pass over each row's prompt plus answer gives the
head's features (the target's hidden states) and its soft labels (the target's top-8
next-token distribution); nothing is generated.  Steps:

1. **Read** the committed rows of ``--from`` (only the parts the manifest names; a data
   file it does not name, from a run in progress or killed, is not read and is counted),
   and the job's config from its ``_summary.json`` (or ``--config`` when the run did not
   finish).  The target (``models.target``, or ``--target``) must have the files the
   manifest recorded.
2. **Rebuild** each row's prompt token ids exactly as the job did: the row's input text is
   recovered from its ``prompt`` column by the job's template and chat template
   (:class:`pipeline.prompts.PromptBuilder` with the job's ``task:``), built again, and the
   rebuilt prompt must equal the stored one and have its ``prompt_tokens`` ids.  The
   answer's ids are the output text re-tokenized (the output stores the text, not the ids),
   with the EOS the job generated when it finished on EOS; a row whose re-tokenized answer
   has another length than its ``new_tokens`` is still used, and counted
   (``answers_retokenized_exactly``).  Failed rows and rows with an empty answer are left out,
   counted by reason.
3. **Hold back** ``--holdout`` of the rows (chosen by a hash of the row id and ``--seed``,
   the same rows on every rerun), and measure the starting head's acceptance on them.
4. **Train** ``--steps`` AdamW steps (:mod:`train.draft_head_training`: the unroll over
   draft positions 1-3, cross-entropy against the target's top-8 distribution on the
   draft vocabulary, answer tokens weighted 4x, 30 % of prompt positions sampled), the
   rows in a seeded order, epoch after epoch.  Every 10 steps, and at the end,
   ``<output>/train_state.pt`` keeps the head, the optimizer's state and the position in
   the row order: a rerun with the same ``--output`` continues where it stopped (a rerun
   with a larger ``--steps`` trains on); a different output, ``--holdout`` or ``--seed`` is
   refused.
5. **Measure** the trained head (as saved, bfloat16) on the held-back rows and write
   ``<output>/report.json``; with ``--promote-to DIR``, copy the head to ``DIR`` only when
   it beats the current head there (or, for an empty ``DIR``, the starting head).

Acceptance, teacher-forced: at every block start in an answer (each committed length from
the first answer token on), the head drafts ``k`` tokens greedily, chained on its own
output, exactly as method ``eagle`` drafts (its window of the last 64 prompt positions
included); a draft is accepted while it equals the target's answer token.  Per ``k = 1 ..
--max-draft``: the acceptance rate (accepted / drafted), the mean accepted length (tokens
per verification step, the bonus token included) and the acceptance by draft position.
With greedy decoding the answer tokens are the target's argmax, so these are the figures
greedy verification would give on every block start (the engine's own blocks are a subset).
*Better* means a higher mean accepted length at ``k = --max-draft``.

The starting head: ``--head``; else the job's ``models.drafter`` when the job ran method
``eagle``; else a new head shaped for the target (its last hidden state as the feature, a
tied output layer over the 16,384 ids most frequent in the training answers, warm-started
as in ``train/train_smollm2_draft_head.py``).

Exit status: 0 on success (whether or not the head was promoted), 2 for bad input before
any training (not a job output, no usable rows, no rows held back, a missing model or head,
an ``--output`` or ``--promote-to`` holding something else), 1 for any other failure.
"""


import hashlib
import json
import os
import random
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the repo root: pipeline/, train/

from pipeline.imports import require_packages  # noqa: E402

require_packages("jobs/train_drafter.py")  # one line, exit 2, under a Python that lacks torch & co.

from pipeline.config import JobRefused  # noqa: E402

STATE = "train_state.pt"
REPORT = "report.json"
#: the files this job writes in --output (and, promoted, in --promote-to)
HEAD_FILES = ("model.safetensors", "config.json")
OWN_FILES = (*HEAD_FILES, STATE, REPORT)
#: what a killed run of this job may leave behind (its temporary names)
OWN_TEMPORARY = (".saving", f"{STATE}.tmp", f"{REPORT}.tmp", *(f".{n}.tmp" for n in (*HEAD_FILES, REPORT)))
#: head positions per training window (the end of each row: its answer and the prompt before it)
MAX_LEN = 384
UNROLL, STEP_DECAY, ANSWER_WEIGHT, PROMPT_FRACTION, TOP_K = 3, 0.8, 4.0, 0.3, 8
NEW_HEAD_VOCAB = 16384
SAVE_EVERY = 10


class TrainDrafterError(JobRefused):
    """Bad input to ``jobs/train_drafter.py``, found before any training (exit 2)."""


@dataclass
class Options:
    """The job's settings (``--help`` shows these defaults)."""

    source: str | None = None
    output: str | None = None
    config: str | None = None
    target: str | None = None
    head: str | None = None
    steps: int = 40
    holdout: float = 0.1
    max_draft: int = 4
    promote_to: str | None = None
    lr: float = 5e-4
    tokens_per_step: int = 1024
    max_rows: int | None = None
    seed: int = 0
    storage_options: dict = field(default_factory=dict)


def build_parser():
    """The parser of ``jobs/train_drafter.py`` (flags: :mod:`pipeline.flags`)."""
    from pipeline.flags import build_parser as build_job_parser

    d = Options()
    return build_job_parser(
        "train_drafter", __doc__.split("\n")[0],
        defaults={"steps": d.steps, "holdout": d.holdout, "max_draft": d.max_draft, "lr": d.lr,
                  "tokens_per_step": d.tokens_per_step, "seed": d.seed, "storage_options": "{}"},
        notes={"config": "the job's config; needed only when the output has no _summary.json",
               "target": "default: the job's models.target",
               "head": "default: the job's models.drafter when it ran method eagle, else a new head",
               "output": "required: the trained head (config.json, model.safetensors), train_state.pt, report.json",
               "max_draft": "acceptance is measured at k = 1 .. K"})


def options_from_args(args) -> Options:
    so = json.loads(args.storage_options or "{}")
    if args.endpoint_url:
        so.setdefault("client_kwargs", {})["endpoint_url"] = args.endpoint_url
    return Options(source=args.source, output=args.output, config=args.config, target=args.target, head=args.head,
                   steps=args.steps, holdout=args.holdout, max_draft=args.max_draft, promote_to=args.promote_to,
                   lr=args.lr, tokens_per_step=args.tokens_per_step, max_rows=args.max_rows, seed=args.seed,
                   storage_options=so)


def log(msg: str) -> None:
    print(f"[train_drafter {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the job's output
@dataclass
class JobOutput:
    """The committed rows of a job output and what they were made with."""

    uri: str
    rows: list[dict]
    config: dict  # the job's resolved config sections (task, models, generation, method)
    identity: dict  # the config identity of the committed shards (pipeline.fingerprint)
    parts: dict  # part name -> run id that committed it
    uncommitted_files: list[str]
    generation: dict


def read_job_output(uri: str, storage_options: dict, config_path: str | None, max_rows: int | None) -> JobOutput:
    """The committed rows of the job output ``uri`` (:class:`JobOutput`).

    Raises:
        TrainDrafterError: not a job output (no manifest; a folder of ``date=`` partitions is
            named as such), a manifest naming a missing file, no config (no ``_summary.json``
            and no ``--config``), a ``--config`` whose task differs from the output's.
    """
    import pyarrow.parquet as pq

    from pipeline.config import OutputConfig, load_config
    from pipeline.output import OutputLocation
    from pipeline.output.layout import DATA_FILE, SUMMARY

    try:
        loc = OutputLocation(OutputConfig(uri=uri, partition_by_date=False, storage_options=storage_options))
    except (ValueError, OSError) as e:
        raise TrainDrafterError(f"--from {uri!r}: {e}") from None
    entries = loc.read_manifest()
    if not entries:
        listing = loc.listing()
        days = sorted({p.split("/", 1)[0] for p in listing if p.startswith("date=") and "/_manifest/" in p})
        if days:
            raise TrainDrafterError(f"--from {uri!r} holds date partitions, not one job output: pass one of them, "
                                    f"e.g. {uri.rstrip('/')}/{days[-1]}")
        what = "does not exist" if not listing else "has no committed unit (_manifest/part-*.json)"
        raise TrainDrafterError(f"--from {uri!r} is not a job output: it {what}")
    summary = loc.read_summary() if loc.exists(loc.path(SUMMARY)) else None
    identity = next(iter(entries.values())).get("config_identity") or {}
    if summary is not None and summary.get("config"):
        config = summary["config"]
        generation = summary.get("generation") or config.get("generation") or {}
    elif config_path:
        cfg = load_config(config_path)
        config = cfg.resolved()
        generation = config.get("generation") or {}
        task = {k: v for k, v in config["task"].items() if v is not None}
        if identity.get("task") is not None and task != identity["task"]:
            changed = sorted(k for k in set(task) | set(identity["task"]) if task.get(k) != identity["task"].get(k))
            raise TrainDrafterError(f"--config {config_path!r} does not match the output's task settings "
                                    f"(task.{', task.'.join(changed)} differ): its prompts cannot be rebuilt from it")
    else:
        raise TrainDrafterError(f"--from {uri!r} has no {SUMMARY} (the run did not finish): give the job's config "
                                "with --config")
    committed = {f for e in entries.values() for f in e["files"]}
    uncommitted = [p for p in loc.listing() if "/" not in p and DATA_FILE.fullmatch(p) and p not in committed]
    rows: list[dict] = []
    columns = ["id", "prompt", "output_text", "finish_reason", "error", "prompt_tokens", "new_tokens"]
    for part in sorted(entries):
        for name in entries[part]["files"]:
            path = loc.path(name)
            if not loc.exists(path):
                raise TrainDrafterError(f"--from {uri!r}: the manifest's {part} names {name}, which is missing")
            with loc.fs.open(path, "rb") as f:
                table = pq.read_table(f, columns=columns)
            rows += table.to_pylist()
            if max_rows is not None and len(rows) >= max_rows:
                break
        if max_rows is not None and len(rows) >= max_rows:
            rows = rows[:max_rows]
            break
    parts = {p: e.get("run_id") for p, e in entries.items()}
    return JobOutput(loc.url(), rows, config, identity, parts, uncommitted, generation)


def check_target_files(target_path: str, identity: dict) -> None:
    """Refuse a target whose files differ from those the output's manifest recorded."""
    from pipeline.fingerprint import model_files

    recorded = (identity.get("model_files") or {}).get("target")
    if not recorded or "hub_id" in recorded:
        return
    now = model_files(target_path)
    changed = sorted(k for k in set(now) | set(recorded) if now.get(k) != recorded.get(k))
    if changed:
        raise TrainDrafterError(f"the target {target_path!r} is not the model the job ran: {', '.join(changed)} "
                                "differ from the output's manifest (give the job's target with --target)")


# ----------------------------------------------------------------------------- rows -> token ids
def prompt_ids(builder, prompt: str) -> list[int] | None:
    """The job's token ids of a row's ``prompt`` column, or ``None`` when the job's template
    does not reproduce it: the text is what lies between the template's parts, built again
    with :meth:`PromptBuilder.build` (which keeps special-token strings of the text as text)."""
    mark = "\x00specbatch-text\x00"
    skeleton = builder.render(mark)
    if skeleton.count(mark) != 1:
        return None
    pre, post = skeleton.split(mark)
    if not (prompt.startswith(pre) and prompt.endswith(post) and len(prompt) > len(pre) + len(post)):
        return None
    text = prompt[len(pre): len(prompt) - len(post)]
    try:
        again, ids = builder.build(text)
    except ValueError:
        return None
    return ids if again == prompt else None


@dataclass
class Row:
    id: str
    ids: list[int]  # prompt + answer
    prompt_len: int
    exact_answer: bool  # the re-tokenized answer has the job's new_tokens ids


def rows_to_ids(job: JobOutput, tokenizer, task, eos_ids: list[int], stop_strings: list[str]) -> tuple[list[Row], dict]:
    """Each usable row's prompt and answer ids, and the counts of rows left out, by reason."""
    from pipeline.prompts import PromptBuilder

    builder = PromptBuilder(tokenizer, task)
    out, skipped = [], {}

    def skip(reason):
        skipped[reason] = skipped.get(reason, 0) + 1

    for r in job.rows:
        if r.get("error") or r.get("output_text") is None or r.get("prompt") is None:
            skip("failed")
            continue
        p = prompt_ids(builder, r["prompt"])
        if p is None:
            skip("prompt not reproduced by the job's task settings")
            continue
        if r.get("prompt_tokens") is not None and len(p) != r["prompt_tokens"]:
            skip("prompt ids differ from the job's prompt_tokens")
            continue
        a = list(tokenizer(r["output_text"], add_special_tokens=False)["input_ids"])
        text = r["output_text"]
        if (r.get("finish_reason") == "stop" and eos_ids and not any(text.endswith(s) for s in stop_strings)
                and (r.get("new_tokens") is None or len(a) < r["new_tokens"])):
            a.append(eos_ids[0])  # the EOS the job generated (skipped in output_text)
        if not a:
            skip("empty answer")
            continue
        out.append(Row(str(r["id"]), p + a, len(p), r.get("new_tokens") == len(a)))
    return out, skipped


def held_back(row_id: str, fraction: float, seed: int) -> bool:
    """Whether a row is held back: a hash of its id and ``seed``, the same on every rerun."""
    h = hashlib.sha256(f"{seed}:{row_id}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < fraction


# ----------------------------------------------------------------------------- teacher forcing
def teacher_forced(target, ids: list[int], stored: list[int], eos_ids: list[int], start: int = 0, dtype=None):
    """One target pass over ``ids[:-1]`` (no generation): the features at the ``stored``
    hidden-state layers ``(T-1-start, m, H)`` (``dtype``, default bfloat16) and the top-8 log-probabilities of
    positions ``start .. T-2``, as a training record (:func:`train.draft_head_training.record`)
    of ``ids[start:]``; and the target's argmax at each position.  A final EOS takes the one
    of ``eos_ids`` the target ranks highest."""
    import torch

    from train.draft_head_training import topk_logprobs

    with torch.inference_mode():
        x = torch.tensor([ids[:-1]], device=next(target.parameters()).device)
        out = target(input_ids=x, output_hidden_states=True, use_cache=False)
        logits = out.logits[0, start:].float().cpu()
        feats = torch.stack([out.hidden_states[i][0, start:] for i in stored], dim=1).to(dtype or torch.bfloat16).cpu()
    if len(eos_ids) > 1 and ids[-1] in eos_ids:
        ids = ids[:-1] + [max(eos_ids, key=lambda e: float(logits[-1, e]))]
    v, i = topk_logprobs(logits, TOP_K)
    return feats, v, i, logits.argmax(-1), ids[start:]


def stored_layers(head) -> list[int]:
    """The hidden states a record keeps: the head's feature layers and the last (the
    regression target :func:`make_batch` reads)."""
    return sorted(set(head.head_config.feature_layers) | {head.head_config.target_num_hidden_layers})


def train_record(target, row: Row, stored: list[int], eos_ids: list[int]) -> dict:
    """A training record of ``row``: its last :data:`MAX_LEN` + 2 positions (the window
    :func:`make_batch` keeps of an answer)."""
    from train.draft_head_training import record

    start = max(0, len(row.ids) - 2 - MAX_LEN)
    feats, v, i, _, ids = teacher_forced(target, row.ids, stored, eos_ids, start)
    return record(ids, row.prompt_len - start, feats, v, i, "answer")


@dataclass
class HeldOut:
    """A held-back row as the head sees it at inference: the positions from the head's
    catch-up window before the answer on (:data:`~pipeline.engine.proposers.base.CATCH_UP_WINDOW`)."""

    ids: Any  # (T,) int64
    prompt_len: int
    feats: dict  # layer -> (T-1, H), the target's dtype (what the engine feeds the head)
    argmax_agrees: int  # answer tokens equal to the target's argmax
    answer_tokens: int


def held_out_record(target, row: Row, layers: list[int], eos_ids: list[int]) -> HeldOut:
    import torch

    from pipeline.engine.proposers.base import CATCH_UP_WINDOW

    start = max(0, row.prompt_len - CATCH_UP_WINDOW)
    feats, _, _, argmax, ids = teacher_forced(target, row.ids, layers, eos_ids, start,
                                              dtype=next(target.parameters()).dtype)
    ids = torch.tensor(ids, dtype=torch.long)
    P = row.prompt_len - start
    agree = int((argmax[P - 1:] == ids[P:]).sum())
    return HeldOut(ids, P, {layer: feats[:, n] for n, layer in enumerate(layers)}, agree, len(ids) - P)


def acceptance(head, held: list[HeldOut], max_k: int) -> dict:
    """Teacher-forced acceptance of greedy drafts against the answer tokens, per ``k``.

    Block start ``L`` (committed ids ``x_0 .. x_{L-1}``, ``L`` from the first answer token
    on): draft ``s`` is the head's argmax at step ``s`` of its unroll at position
    ``L - 3 + s`` (chained on its own output, fed the answer's tokens, which are its drafts
    while they are accepted) and is compared with ``x_{L-1+s}``; a block drafts at most the
    tokens left in the answer.

    Returns:
        ``{"blocks", "by_k": {k: {"acceptance_rate", "mean_accepted_length",
        "acceptance_by_position"}}}``.
    """
    import torch

    from train.draft_head_training import unrolled

    drafted = torch.zeros(max_k, dtype=torch.long)  # per draft position s, blocks that draft it
    accepted = torch.zeros(max_k, dtype=torch.long)  # ... and accept it (and every earlier one)
    blocks = 0
    with torch.no_grad():
        for r in held:
            T, P = r.ids.shape[0], r.prompt_len
            p = head.project({layer: f.unsqueeze(0) for layer, f in r.feats.items()})
            e = head.embed(r.ids[1:].unsqueeze(0))
            outs = unrolled(head, p, e, max_k)
            L = torch.arange(P + 1, T)  # block starts
            if L.numel() == 0:
                continue
            blocks += L.numel()
            alive = torch.ones(L.numel(), dtype=torch.bool)
            for s in range(1, max_k + 1):
                j = L - 3 + s
                has = L - 1 + s <= T - 1
                pred = head.draft_vocab[head.logits(outs[s - 1][0]).argmax(-1)]  # (T-1,)
                ok = torch.zeros_like(alive)
                ok[has] = pred[j[has]] == r.ids[(L - 1 + s)[has]]
                alive = alive & ok
                drafted[s - 1] += int(has.sum())
                accepted[s - 1] += int((alive & has).sum())
    by_k = {}
    for k in range(1, max_k + 1):
        d, a = int(drafted[:k].sum()), int(accepted[:k].sum())
        by_k[k] = {"acceptance_rate": round(a / d, 4) if d else None,
                   "mean_accepted_length": round(1 + a / blocks, 4) if blocks else None,
                   "acceptance_by_position": [round(int(accepted[s]) / max(1, int(drafted[s])), 4) for s in range(k)]}
    return {"blocks": blocks, "by_k": by_k}


def score(acc: dict, k: int) -> float:
    """What *better* compares: the mean accepted length at ``k``."""
    return acc["by_k"][k]["mean_accepted_length"] or 0.0


# ----------------------------------------------------------------------------- heads
def new_head(target, rows: list[Row]):
    """A new head for ``target``: its last hidden state as the feature, tied output layer
    over the answers' most frequent ids (then the rest in id order), warm-started."""
    import torch

    from pipeline.engine.draft_head import DraftHead, DraftHeadConfig
    from train.draft_head_training import init_head

    V = target.config.get_text_config().vocab_size
    counts = torch.zeros(V, dtype=torch.float64)
    for r in rows:
        a = torch.tensor(r.ids[r.prompt_len:], dtype=torch.long).clamp(0, V - 1)
        counts.index_add_(0, a, torch.ones(a.numel(), dtype=torch.float64))
    order = torch.argsort(-counts, stable=True)
    N = min(NEW_HEAD_VOCAB, V)
    config = DraftHeadConfig.for_target(target, draft_vocab_size=N, tie_lm_head=True)
    head = DraftHead(config)
    head.set_draft_vocab(order[:N])
    head.to(dtype=next(target.parameters()).dtype)
    init_head(head, target, "identity")
    return head.attach(target)


def check_folder_for_writing(path: str, flag: str, head_ok: bool) -> None:
    """Refuse a folder holding files this job did not write (a draft head's, when
    ``head_ok``, plus its own)."""
    from pipeline.engine.draft_head import is_draft_head

    if not os.path.exists(path):
        return
    if not os.path.isdir(path):
        raise TrainDrafterError(f"{flag} {path!r} is a file, not a folder")
    names = set(os.listdir(path))
    foreign = sorted(names - set(OWN_FILES) - set(OWN_TEMPORARY))
    if head_ok and is_draft_head(path):
        foreign = sorted(n for n in foreign if n not in ("README.md", "training_summary.json"))
    if foreign:
        raise TrainDrafterError(f"{flag} {path!r} holds files this job did not write ({', '.join(foreign[:5])}); "
                                "it touches nothing it did not write: choose another folder")
    if names & set(HEAD_FILES) and not is_draft_head(path):
        raise TrainDrafterError(f"{flag} {path!r} holds a config.json that is not a draft head's")


def write_head_files(src: str, dst: str) -> None:
    """Copy the head of ``src`` into ``dst``, each file through a temporary name and an
    atomic rename (weights first, then the config that names them)."""
    os.makedirs(dst, exist_ok=True)
    for name in (*HEAD_FILES, REPORT):
        tmp = os.path.join(dst, f".{name}.tmp")
        shutil.copyfile(os.path.join(src, name), tmp)
        os.replace(tmp, os.path.join(dst, name))


def _save_json(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- the job
def run(opts: Options) -> dict:
    """Run the job (see the module docstring); returns the report.

    Raises:
        TrainDrafterError, ModelError, ConfigError, OutputError: bad input, before training.
    """
    import torch

    from pipeline.config import ModelsConfig, TaskConfig
    from pipeline.engine.draft_head import DraftHead, DraftHeadConfig, is_draft_head, load_draft_head, save_draft_head
    from pipeline.models import check_model_path, load_models
    from train.draft_head_training import Data, make_batch, make_optimizer, lr_scale, train_step

    t_start = time.time()
    if not opts.source:
        raise TrainDrafterError("--from is required: a job's output folder")
    if not opts.output:
        raise TrainDrafterError("--output is required: the folder the trained head goes to")
    if not 0 < opts.holdout < 1:
        raise TrainDrafterError(f"--holdout must be between 0 and 1, got {opts.holdout}")
    if opts.steps < 0 or opts.max_draft < 1 or opts.tokens_per_step < 1 or opts.lr <= 0:
        raise TrainDrafterError("--steps must be >= 0, --max-draft and --tokens-per-step >= 1, --lr > 0")
    out_dir = os.path.abspath(os.path.expanduser(opts.output))
    check_folder_for_writing(out_dir, "--output", head_ok=False)
    promote = os.path.abspath(os.path.expanduser(opts.promote_to)) if opts.promote_to else None
    if promote:
        check_folder_for_writing(promote, "--promote-to", head_ok=True)
    if opts.head and not is_draft_head(opts.head):
        raise TrainDrafterError(f"--head {opts.head!r} is not a draft-head folder (config.json with model_type "
                                "'specbatch_draft_head' and model.safetensors)")

    job = read_job_output(opts.source, opts.storage_options, opts.config, opts.max_rows)
    models_cfg = dict(job.config["models"])
    if opts.target:
        models_cfg["target"] = opts.target
    models = ModelsConfig(**{k: v for k, v in models_cfg.items() if k in ModelsConfig.model_fields})
    check_model_path(models.target, "--target" if opts.target else "models.target (the job's target)",
                     models.trust_remote_code, models.gguf_file)
    check_target_files(models.target, job.identity)
    start_from = opts.head
    method = (job.config.get("method") or {}).get("name")
    if start_from is None and method == "eagle" and models.drafter and is_draft_head(models.drafter):
        start_from = models.drafter
    if job.uncommitted_files:
        log(f"note: {len(job.uncommitted_files)} data file(s) no manifest entry names (a run in progress or killed) "
            f"are not read: {', '.join(job.uncommitted_files[:3])}")

    try:
        loaded = load_models(models, uses_drafter=False, device="cpu")
    except (OSError, ValueError) as e:
        raise TrainDrafterError(f"the target {models.target!r} does not load: {type(e).__name__}: {e}") from None
    target, tokenizer = loaded.target, loaded.tokenizer
    for p in target.parameters():
        p.requires_grad_(False)
    gen = job.generation
    eos = gen.get("eos_token_id", target.generation_config.eos_token_id)
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    task = TaskConfig(**job.config["task"])
    rows, skipped = rows_to_ids(job, tokenizer, task, eos_ids, list(gen.get("stop_strings") or []))
    held_rows = [r for r in rows if held_back(r.id, opts.holdout, opts.seed)]
    train_rows = [r for r in rows if not held_back(r.id, opts.holdout, opts.seed)]
    if not rows:
        raise TrainDrafterError(f"--from {opts.source!r}: no usable rows among {len(job.rows)} committed "
                                f"(left out: {skipped or 'none committed'})")
    if not held_rows or not train_rows:
        raise TrainDrafterError(f"--holdout {opts.holdout} leaves {len(held_rows)} of {len(rows)} rows held back and "
                                f"{len(train_rows)} to train on: both need one at least")
    log(f"{len(job.rows)} committed rows of {job.uri}: {len(train_rows)} to train on, {len(held_rows)} held back"
        + (f", left out {skipped}" if skipped else ""))

    # the starting head (or the one a previous run of this --output trained)
    state_file = os.path.join(out_dir, STATE)
    source_id = {"uri": job.uri, "parts": job.parts, "holdout": opts.holdout, "seed": opts.seed,
                 "max_rows": opts.max_rows}
    saved = torch.load(state_file, weights_only=False) if os.path.isfile(state_file) else None
    if saved is not None and saved["source"] != source_id:
        raise TrainDrafterError(f"--output {opts.output!r} holds the training on another output or with other "
                                "--holdout / --seed / --max-rows: choose another --output")
    if saved is not None:
        start_from = saved["start_from"]
    if start_from is not None:
        try:
            head = load_draft_head(start_from, target)
        except ValueError as e:
            raise TrainDrafterError(f"the starting head {start_from!r}: {e}") from None
    else:
        head = new_head(target, train_rows)
    head_layers = list(head.head_config.feature_layers)
    stored = stored_layers(head)
    log(f"measuring {len(held_rows)} held-back rows (one target pass each)")
    held = [held_out_record(target, r, head_layers, eos_ids) for r in held_rows]
    before = saved["before"] if saved is not None else acceptance(head, held, opts.max_draft)
    if saved is not None:
        with torch.inference_mode(False):
            head = DraftHead(DraftHeadConfig.from_dict(saved["head_config"]))
            head.load_state_dict(saved["head"])
        head.to(dtype=next(target.parameters()).dtype).attach(target)

    # train
    V = target.config.get_text_config().vocab_size
    vocab_index = torch.full((V,), -1, dtype=torch.long)
    vocab_index[head.draft_vocab] = torch.arange(head.draft_vocab.numel())
    opt, params = make_optimizer(head, opts.lr)
    st = {"step": 0, "epoch": 0, "position": 0, "losses": [], "rows_seen": 0, "seconds": 0.0}
    if saved is not None:
        opt.load_state_dict(saved["optimizer"])
        st = saved["state"]
        log(f"resuming at step {st['step']} (epoch {st['epoch']}, row {st['position']} of its order)")

    def order(epoch: int) -> list[int]:
        idx = list(range(len(train_rows)))
        random.Random(opts.seed * 1_000_003 + epoch).shuffle(idx)
        return idx

    def save_state() -> None:
        os.makedirs(out_dir, exist_ok=True)
        tmp = state_file + ".tmp"
        torch.save({"source": source_id, "start_from": start_from, "before": before,
                    "head_config": head.head_config.to_dict(), "head": head.state_dict(),
                    "optimizer": opt.state_dict(), "state": st}, tmp)
        os.replace(tmp, state_file)

    t0 = time.time() - st["seconds"]
    perm = order(st["epoch"])
    head.train()
    while st["step"] < opts.steps:
        batch_recs, n_tok = [], 0
        while n_tok < opts.tokens_per_step:
            if st["position"] >= len(perm):
                st["epoch"] += 1
                st["position"] = 0
                perm = order(st["epoch"])
            rec = train_record(target, train_rows[perm[st["position"]]], stored, eos_ids)
            st["position"] += 1
            st["rows_seen"] += 1
            if rec["ids"].shape[0] > 3:
                batch_recs.append(rec)
                n_tok += min(MAX_LEN, rec["ids"].shape[0])
            elif len(train_rows) == 1:
                break
        if not batch_recs:
            raise TrainDrafterError("the rows to train on are too short (3 tokens or fewer)")
        batch = make_batch(Data(batch_recs, stored), batch_recs, head, head_layers, MAX_LEN,
                           random.Random(opts.seed + st["step"]), PROMPT_FRACTION, ANSWER_WEIGHT, UNROLL, vocab_index)
        warm = min(1.0, (st["step"] + 1) / max(1, opts.steps // 10))
        lr = opts.lr * lr_scale(st["step"] / max(1, opts.steps), warm)
        loss, agree = train_step(head, opt, params, batch, UNROLL, STEP_DECAY, 0.0, False, lr)
        st["step"] += 1
        st["losses"].append(loss)
        st["seconds"] = time.time() - t0
        if st["step"] % SAVE_EVERY == 0 or st["step"] == opts.steps:
            save_state()
            log(f"step {st['step']}/{opts.steps} loss {statistics.mean(st['losses'][-SAVE_EVERY:]):.3f} top-1 by "
                f"position {[round(a, 3) for a in agree]} lr {lr:.2e} ({st['seconds']:.0f} s, epoch {st['epoch']})")
    head.eval()
    save_state()

    # the trained head as saved (bfloat16), measured as the engine will load it
    config = head.head_config
    config.training = {"script": "jobs/train_drafter.py", "from": job.uri, "continued_from": start_from or "a new head",
                       "steps": st["step"], "rows_trained_on": len(train_rows), "rows_held_back": len(held_rows)}
    tmp_dir = os.path.join(out_dir, ".saving")
    save_draft_head(head, tmp_dir)
    for name in HEAD_FILES:  # weights first, then the config that names them
        os.replace(os.path.join(tmp_dir, name), os.path.join(out_dir, name))
    os.rmdir(tmp_dir)
    trained = load_draft_head(out_dir, target)
    after = acceptance(trained, held, opts.max_draft)
    K = opts.max_draft

    # the current head: the one in --promote-to, else the starting head
    current, current_acc = "the starting head", before
    if promote and is_draft_head(promote) and (start_from is None or os.path.realpath(promote) != os.path.realpath(start_from)):
        current = promote
        try:
            cur = load_draft_head(promote, target)
        except ValueError as e:
            raise TrainDrafterError(f"--promote-to {promote!r}: {e}") from None
        current_acc = acceptance(cur, [held_out_record(target, r, list(cur.head_config.feature_layers), eos_ids)
                                       for r in held_rows], K)
    elif promote and start_from is not None:
        current = start_from
    better = score(after, K) > score(current_acc, K)
    exact = sum(r.exact_answer for r in rows)
    report = {
        "from": job.uri, "target": models.target, "started_from": start_from or "a new head",
        "rows": {"committed": len(job.rows), "used": len(rows), "trained_on": len(train_rows),
                 "held_back": len(held_rows), "left_out": skipped, "uncommitted_files_not_read": len(job.uncommitted_files),
                 "answers_retokenized_exactly": exact,
                 "held_back_answer_tokens_equal_to_the_targets_argmax":
                     round(sum(h.argmax_agrees for h in held) / max(1, sum(h.answer_tokens for h in held)), 4)},
        "training": {"steps": st["step"], "epochs": st["epoch"], "rows_seen": st["rows_seen"],
                     "seconds": round(st["seconds"], 1), "lr": opts.lr, "tokens_per_step": opts.tokens_per_step,
                     "final_loss": round(statistics.mean(st["losses"][-10:]), 4) if st["losses"] else None},
        "acceptance": {"method": "teacher-forced greedy drafts against the answer tokens, every block start",
                       "max_draft": K, "before": before, "after": after,
                       **({"current": {"head": current, **current_acc}} if current_acc is not before else {})},
        "better": "trained" if better else "current",
        "compared": {"mean_accepted_length_at_k": K, "trained": score(after, K), "current": score(current_acc, K),
                     "current_head": current},
        "promoted_to": None, "seconds": round(time.time() - t_start, 1),
    }
    _save_json(os.path.join(out_dir, REPORT), report)
    if promote and better:
        write_head_files(out_dir, promote)
        report["promoted_to"] = promote
        _save_json(os.path.join(out_dir, REPORT), report)
        _save_json(os.path.join(promote, REPORT), report)
    return report


def print_report(report: dict) -> None:
    acc = report["acceptance"]
    K = acc["max_draft"]
    rows = report["rows"]
    print(f"held-back rows: {rows['held_back']} ({acc['before']['blocks']} block starts); trained "
          f"{report['training']['steps']} steps on {rows['trained_on']} rows")
    print("acceptance, teacher-forced greedy drafts (rate α, mean accepted length τ):")
    print("   k   before α  before τ   after α  after τ")
    for k in range(1, K + 1):
        b, a = acc["before"]["by_k"][k], acc["after"]["by_k"][k]
        print(f"  {k:2d}   {b['acceptance_rate'] or 0:7.3f}  {b['mean_accepted_length'] or 0:8.3f}  "
              f"{a['acceptance_rate'] or 0:8.3f}  {a['mean_accepted_length'] or 0:7.3f}")
    c = report["compared"]
    print(f"better: {report['better']} (τ at k={K}: trained {c['trained']:.3f}, current {c['current']:.3f}, "
          f"{c['current_head']})" + (f"; promoted to {report['promoted_to']}" if report["promoted_to"] else
                                     "; not promoted" if report["better"] == "current" else ""))


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        opts = options_from_args(args)
    except json.JSONDecodeError as e:
        print(f"error: --storage-options is not JSON: {e}", file=sys.stderr)
        return 2
    try:
        report = run(opts)
    except JobRefused as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - one line, exit 1
        print(f"error: {type(e).__name__}: {' '.join(str(e).split())[:500]}", file=sys.stderr)
        return 1
    print_report(report)
    print(f"report: {os.path.join(os.path.abspath(opts.output), REPORT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
