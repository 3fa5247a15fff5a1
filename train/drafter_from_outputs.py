"""Training, or continuing, the draft head of method ``eagle`` on a job's own committed
outputs: the library behind ``jobs/train_drafter.py`` (its flags, ``main`` and printed
report stay there).

Teacher-forced self-distillation (online speculative decoding, Liu et al. 2023; EAGLE's
recipe, Li et al. 2024, with EAGLE-3's training-time test): the job's committed rows are the
target's own answers, so one target pass over each row's prompt plus answer gives the
head's features (the target's hidden states) and its soft labels (the target's top-8
next-token distribution); nothing is generated.  Steps (:func:`run`):

1. **Read** the committed rows of ``--from`` (:class:`pipeline.output.reader.CommittedOutput`:
   only the units its commit log commits; a data file no committed unit names, from a run in
   progress, killed or that lost its lease, is not read and is counted; an output whose
   units carry several config fingerprints is refused), and the job's config from its ``_summary.json`` (or
   ``--config`` when the run did not finish).  The target (``models.target``, or
   ``--target``) must have the files the committed units recorded.
2. **Rebuild** each row's prompt token ids exactly as the job did: the row's input text is
   recovered from its ``prompt`` column by the job's template and chat template
   (:class:`pipeline.prompts.PromptBuilder` with the job's ``task:``), built again, and the
   rebuilt prompt must equal the stored one and have its ``prompt_tokens`` ids.  The
   answer's ids are the row's ``output_token_ids``, exactly what the target generated (counted:
   ``answers_from_token_ids``); an output written before that column existed stores only the
   text, which is re-tokenized, with the EOS the job generated when it finished on EOS; a row
   whose re-tokenized answer has another length than its ``new_tokens`` is still used, and
   counted (``answers_retokenized_exactly`` counts the exact ones, stored ids included).  Failed rows and rows with an empty answer are left out,
   counted by reason.
3. **Hold back** ``--holdout`` of the rows (chosen by a hash of the row id and ``--seed``,
   the same rows on every rerun), and measure the starting head's acceptance on them.
4. **Train** ``--steps`` AdamW steps (:mod:`train.draft_head_training`: the unroll over
   draft positions 1-3, cross-entropy against the target's top-8 distribution on the
   draft vocabulary, answer tokens weighted 4x, 30 % of prompt positions sampled), the
   rows in a seeded order, epoch after epoch.  Every :data:`SAVE_EVERY` steps, and at the
   end, ``<output>/train_state.safetensors`` (safetensors + JSON, :mod:`train.state_files`; never a pickle) keeps the head, the optimizer's state and the position
   in the row order: a rerun with the same ``--output`` continues where it stopped (a rerun
   with a larger ``--steps`` trains on); a different output, ``--holdout`` or ``--seed`` is
   refused.
5. **Measure** the trained head (as saved, bfloat16) on the held-back rows and write
   ``<output>/report.json``; with ``--promote-to DIR``, copy the head to ``DIR`` only when
   it beats the current head there (or, for an empty ``DIR``, the starting head).

Acceptance, teacher-forced (:func:`train.drafter_acceptance.acceptance`): at every block start in an answer (each
committed length from the first answer token on), the head drafts ``k`` tokens greedily,
chained on its own output, exactly as method ``eagle`` drafts (its window of the last 64
prompt positions included); a draft is accepted while it equals the target's answer token.
Per ``k = 1 .. --max-draft``: the acceptance rate (accepted / drafted), the mean accepted
length (tokens per verification step, the bonus token included) and the acceptance by draft
position.  With greedy decoding the answer tokens are the target's argmax, so these are the
figures greedy verification would give on every block start (the engine's own blocks are a
subset).  *Better* means a higher mean accepted length at ``k = --max-draft``.

The starting head: ``--head``; else the job's ``models.drafter`` when the job ran method
``eagle``; else a new head shaped for the target (its last hidden state as the feature, a
tied output layer over the 16,384 ids most frequent in the training answers, warm-started
as in ``train/train_smollm2_draft_head.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from pipeline.config import JobRefused
from train.drafter_acceptance import (MAX_LEN, HeldOut, acceptance, held_out_record, score,  # noqa: F401
                                      stored_layers, train_record)
from train.state_files import StateFileError, load_state, refuse_pickled, save_state

STATE = "train_state.safetensors"
#: the pickled state an older version wrote: never loaded, refused by name
PICKLED_STATE = "train_state.pt"
REPORT = "report.json"
#: the files this job writes in --output (and, promoted, in --promote-to)
HEAD_FILES = ("model.safetensors", "config.json")
OWN_FILES = (*HEAD_FILES, STATE, REPORT)
#: what a killed run of this job may leave behind (its temporary names)
OWN_TEMPORARY = (".saving", f"{STATE}.tmp", f"{REPORT}.tmp", *(f".{n}.tmp" for n in (*HEAD_FILES, REPORT)))
UNROLL, STEP_DECAY, ANSWER_WEIGHT, PROMPT_FRACTION = 3, 0.8, 4.0, 0.3
NEW_HEAD_VOCAB = 16384
#: steps between two saves of ``train_state.safetensors``
SAVE_EVERY = 10
#: the columns of a job's output rows the training reads
COLUMNS = ["id", "prompt", "output_text", "finish_reason", "error", "prompt_tokens", "new_tokens", "output_token_ids"]


class TrainDrafterError(JobRefused):
    """Bad input to ``jobs/train_drafter.py``, found before any training (exit 2)."""


@dataclass
class Options:
    """The job's settings (``jobs/train_drafter.py --help`` shows these defaults)."""

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


def log(msg: str) -> None:
    print(f"[train_drafter {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the job's output
@dataclass
class JobOutput:
    """The committed rows of a job output and what they were made with."""

    uri: str
    rows: list[dict]
    config: dict  # the job's resolved config sections (task, models, generation, method)
    identity: dict  # the config identity of the committed units (pipeline.fingerprint)
    parts: dict  # part name -> run id that committed it
    uncommitted_files: list[str]
    generation: dict
    finished: bool = True


def read_job_output(uri: str, storage_options: dict, config_path: str | None, max_rows: int | None) -> JobOutput:
    """The committed rows of the job output ``uri`` (:class:`JobOutput`), read by
    :class:`pipeline.output.reader.CommittedOutput` (the rows one batch at a time, up to
    ``max_rows``).

    Raises:
        TrainDrafterError: not a job output (missing, empty, no committed unit; a folder of
            several ``date=`` partitions is named as such), units of several configs, a
            committed unit naming a missing file, no config (no ``_summary.json`` and no
            ``--config``), a ``--config`` whose task differs from the output's.
    """
    from pipeline.config import load_config
    from pipeline.output.reader import CommittedOutput

    try:
        out = CommittedOutput.open(uri, storage_options)
    except JobRefused as e:
        raise TrainDrafterError(f"--from: {e}") from None
    identity = out.config_identity
    if out.summary is not None and out.summary.get("config"):
        config = out.summary["config"]
        generation = out.summary.get("generation") or config.get("generation") or {}
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
        raise TrainDrafterError(f"--from {uri!r} has no _summary.json (the run did not finish): give the job's "
                                "config with --config")
    rows: list[dict] = []
    try:
        for row in out.rows(COLUMNS, provenance=False):
            if max_rows is not None and len(rows) >= max_rows:
                break
            rows.append(row)
    except JobRefused as e:
        raise TrainDrafterError(f"--from: {e}") from None
    parts = {p: e.run_id for p, e in out.entries.items()}
    return JobOutput(out.url, rows, config, identity, parts, out.uncommitted, generation, out.finished)


def check_target_files(target_path: str, identity: dict) -> None:
    """Refuse a target whose files differ from those the output's committed units recorded."""
    from pipeline.fingerprint import model_files

    recorded = (identity.get("model_files") or {}).get("target")
    if not recorded or "hub_id" in recorded:
        return
    now = model_files(target_path)
    changed = sorted(k for k in set(now) | set(recorded) if now.get(k) != recorded.get(k))
    if changed:
        raise TrainDrafterError(f"the target {target_path!r} is not the model the job ran: {', '.join(changed)} "
                                "differ from those the output's committed units recorded (give the job's target "
                                "with --target)")


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
    exact_answer: bool  # the answer's ids are the job's (stored), or re-tokenized to its new_tokens ids
    from_ids: bool = False  # the answer's ids are the row's output_token_ids


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
        stored = r.get("output_token_ids")
        if stored is not None:
            a = [int(t) for t in stored]  # the target's own ids, EOS included when it stopped on it
        else:  # an output written before the column existed: its text re-tokenized
            a = list(tokenizer(r["output_text"], add_special_tokens=False)["input_ids"])
            text = r["output_text"]
            if (r.get("finish_reason") == "stop" and eos_ids and not any(text.endswith(s) for s in stop_strings)
                    and (r.get("new_tokens") is None or len(a) < r["new_tokens"])):
                a.append(eos_ids[0])  # the EOS the job generated (skipped in output_text)
        if not a:
            skip("empty answer")
            continue
        out.append(Row(str(r["id"]), p + a, len(p), stored is not None or r.get("new_tokens") == len(a),
                       stored is not None))
    return out, skipped


def held_back(row_id: str, fraction: float, seed: int) -> bool:
    """Whether a row is held back: a hash of its id and ``seed``, the same on every rerun."""
    h = hashlib.sha256(f"{seed}:{row_id}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < fraction


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
    try:
        refuse_pickled(path, (PICKLED_STATE,))
    except StateFileError as e:
        raise TrainDrafterError(f"{flag}: {e}") from None
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



# ----------------------------------------------------------------------------- the job, by phase
def check_options(opts: Options) -> tuple[str, str | None]:
    """Check the flags and the folders written; returns ``(output folder, promote-to folder or None)``.

    Raises:
        TrainDrafterError: a flag out of range, a folder holding files this job did not write,
            a ``--head`` that is not a draft head.
    """
    from pipeline.engine.draft_head import is_draft_head

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
    read_saved_state(os.path.join(out_dir, STATE))  # a bad state is refused now, before the models load
    promote = os.path.abspath(os.path.expanduser(opts.promote_to)) if opts.promote_to else None
    if promote:
        check_folder_for_writing(promote, "--promote-to", head_ok=True)
    if opts.head and not is_draft_head(opts.head):
        raise TrainDrafterError(f"--head {opts.head!r} is not a draft-head folder (config.json with model_type "
                                "'specbatch_draft_head' and model.safetensors)")
    return out_dir, promote


def read_saved_state(state_file: str) -> dict | None:
    """The training state saved in ``state_file`` (safetensors + JSON), or None when there is none.

    Raises:
        TrainDrafterError: the file is not such a state (a pickle, a truncated file...); named, never run.
    """
    if not os.path.isfile(state_file):
        return None
    try:
        saved = load_state(state_file)
    except StateFileError as e:
        raise TrainDrafterError(f"--output: {e}") from None
    if not isinstance(saved, dict) or not {"source", "start_from", "before", "head_config", "head", "optimizer",
                                           "state"} <= set(saved):
        raise TrainDrafterError(f"--output: {state_file!r} is not this job's training state: delete it to start "
                                "afresh")
    return saved


@dataclass
class Setup:
    """What the training runs on: the job's target (loaded, frozen), its EOS ids, the rows
    (train and held back) and the head it starts from (None: a new head)."""

    models: Any  # pipeline.config.ModelsConfig
    target: Any
    tokenizer: Any
    eos_ids: list[int]
    rows: list[Row]
    train_rows: list[Row]
    held_rows: list[Row]
    skipped: dict
    start_from: str | None


def prepare(opts: Options, job: JobOutput) -> Setup:
    """Check and load the job's target, rebuild the rows' ids, split off the held-back rows.

    Raises:
        TrainDrafterError, ModelError: a target that is not the job's, that does not load;
            no usable row; a holdout leaving no row on either side.
    """
    from pipeline.config import ModelsConfig, TaskConfig
    from pipeline.engine.draft_head import is_draft_head
    from pipeline.models import check_model_path, load_models

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
        log(f"note: {len(job.uncommitted_files)} data file(s) no record of the commit log names (a run in progress, "
            f"killed or that lost its lease) are not read: {', '.join(job.uncommitted_files[:3])}")
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
    rows, skipped = rows_to_ids(job, tokenizer, TaskConfig(**job.config["task"]), eos_ids,
                                list(gen.get("stop_strings") or []))
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
    return Setup(models, target, tokenizer, eos_ids, rows, train_rows, held_rows, skipped, start_from)


class Training:
    """The training state of one ``--output``: the head (the starting one, or the one a
    previous run of this ``--output`` saved), its optimizer, the position in the row order,
    the held-back records and the starting head's acceptance (``before``).

    Raises (on construction):
        TrainDrafterError: ``--output`` holds the training on another output or with other
            ``--holdout`` / ``--seed`` / ``--max-rows``; the starting head does not fit.
    """

    def __init__(self, opts: Options, setup: Setup, job: JobOutput, out_dir: str):
        import torch

        self.opts, self.setup, self.out_dir = opts, setup, out_dir
        self.state_file = os.path.join(out_dir, STATE)
        self.source_id = {"uri": job.uri, "parts": job.parts, "holdout": opts.holdout, "seed": opts.seed,
                          "max_rows": opts.max_rows}
        saved = read_saved_state(self.state_file)
        if saved is not None and saved["source"] != self.source_id:
            raise TrainDrafterError(f"--output {opts.output!r} holds the training on another output or with other "
                                    "--holdout / --seed / --max-rows: choose another --output")
        self.start_from = saved["start_from"] if saved is not None else setup.start_from
        head = self._starting_head()
        self.head_layers = list(head.head_config.feature_layers)
        self.stored = stored_layers(head)
        log(f"measuring {len(setup.held_rows)} held-back rows (one target pass each)")
        self.held = [held_out_record(setup.target, r, self.head_layers, setup.eos_ids) for r in setup.held_rows]
        self.before = saved["before"] if saved is not None else acceptance(head, self.held, opts.max_draft)
        self.head = self._resumed_head(saved) if saved is not None else head
        self._optimizer(saved)

    def _starting_head(self):
        from pipeline.engine.draft_head import load_draft_head

        if self.start_from is None:
            return new_head(self.setup.target, self.setup.train_rows)
        try:
            return load_draft_head(self.start_from, self.setup.target)
        except ValueError as e:
            raise TrainDrafterError(f"the starting head {self.start_from!r}: {e}") from None

    def _resumed_head(self, saved: dict):
        import torch

        from pipeline.engine.draft_head import DraftHead, DraftHeadConfig

        with torch.inference_mode(False):
            head = DraftHead(DraftHeadConfig.from_dict(saved["head_config"]))
            head.load_state_dict(saved["head"])
        head.to(dtype=next(self.setup.target.parameters()).dtype).attach(self.setup.target)
        return head

    def _optimizer(self, saved: dict | None) -> None:
        import torch

        from train.draft_head_training import make_optimizer

        V = self.setup.target.config.get_text_config().vocab_size
        self.vocab_index = torch.full((V,), -1, dtype=torch.long)
        self.vocab_index[self.head.draft_vocab] = torch.arange(self.head.draft_vocab.numel())
        self.opt, self.params = make_optimizer(self.head, self.opts.lr)
        self.st = {"step": 0, "epoch": 0, "position": 0, "losses": [], "rows_seen": 0, "seconds": 0.0}
        if saved is not None:
            self.opt.load_state_dict(saved["optimizer"])
            self.st = saved["state"]
            log(f"resuming at step {self.st['step']} (epoch {self.st['epoch']}, row {self.st['position']} of its order)")

    def order(self, epoch: int) -> list[int]:
        """The training rows' order in ``epoch`` (seeded: the same on every rerun)."""
        idx = list(range(len(self.setup.train_rows)))
        random.Random(self.opts.seed * 1_000_003 + epoch).shuffle(idx)
        return idx

    def save_state(self) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        save_state(self.state_file, {"source": self.source_id, "start_from": self.start_from, "before": self.before,
                                     "head_config": self.head.head_config.to_dict(), "head": self.head.state_dict(),
                                     "optimizer": self.opt.state_dict(), "state": self.st})

    def _batch_records(self, perm: list[int]) -> tuple[list[dict], list[int]]:
        """The next step's training records, about ``--tokens-per-step`` tokens, in the rows'
        order (a new epoch's order when one ends); returns them and the order now in use."""
        st, rows = self.st, self.setup.train_rows
        batch_recs, n_tok = [], 0
        while n_tok < self.opts.tokens_per_step:
            if st["position"] >= len(perm):
                st["epoch"] += 1
                st["position"] = 0
                perm = self.order(st["epoch"])
            rec = train_record(self.setup.target, rows[perm[st["position"]]], self.stored, self.setup.eos_ids)
            st["position"] += 1
            st["rows_seen"] += 1
            if rec["ids"].shape[0] > 3:
                batch_recs.append(rec)
                n_tok += min(MAX_LEN, rec["ids"].shape[0])
            elif len(rows) == 1:
                break
        if not batch_recs:
            raise TrainDrafterError("the rows to train on are too short (3 tokens or fewer)")
        return batch_recs, perm

    def train(self) -> None:
        """``--steps`` steps from where the state is, saved every :data:`SAVE_EVERY` and at the end."""
        import train.draft_head_training as training  # looked up at run time: tests replace train_step

        opts, st = self.opts, self.st
        t0 = time.time() - st["seconds"]
        perm = self.order(st["epoch"])
        self.head.train()
        while st["step"] < opts.steps:
            batch_recs, perm = self._batch_records(perm)
            batch = training.make_batch(training.Data(batch_recs, self.stored), batch_recs, self.head,
                                        self.head_layers, MAX_LEN, random.Random(opts.seed + st["step"]),
                                        PROMPT_FRACTION, ANSWER_WEIGHT, UNROLL, self.vocab_index)
            warm = min(1.0, (st["step"] + 1) / max(1, opts.steps // 10))
            lr = opts.lr * training.lr_scale(st["step"] / max(1, opts.steps), warm)
            loss, agree = training.train_step(self.head, self.opt, self.params, batch, UNROLL, STEP_DECAY, 0.0,
                                              False, lr)
            st["step"] += 1
            st["losses"].append(loss)
            st["seconds"] = time.time() - t0
            if st["step"] % SAVE_EVERY == 0 or st["step"] == opts.steps:
                self.save_state()
                log(f"step {st['step']}/{opts.steps} loss {statistics.mean(st['losses'][-SAVE_EVERY:]):.3f} top-1 "
                    f"by position {[round(a, 3) for a in agree]} lr {lr:.2e} ({st['seconds']:.0f} s, epoch "
                    f"{st['epoch']})")
        self.head.eval()
        self.save_state()

    def save_trained(self, job: JobOutput) -> dict:
        """Save the trained head into ``--output`` (bfloat16, through a temporary folder) and
        measure it as the engine will load it; returns its acceptance."""
        from pipeline.engine.draft_head import load_draft_head, save_draft_head

        config = self.head.head_config
        config.training = {"script": "jobs/train_drafter.py", "from": job.uri,
                            "continued_from": self.start_from or "a new head", "steps": self.st["step"],
                            "rows_trained_on": len(self.setup.train_rows), "rows_held_back": len(self.setup.held_rows)}
        tmp_dir = os.path.join(self.out_dir, ".saving")
        save_draft_head(self.head, tmp_dir)
        for name in HEAD_FILES:  # weights first, then the config that names them
            os.replace(os.path.join(tmp_dir, name), os.path.join(self.out_dir, name))
        os.rmdir(tmp_dir)
        trained = load_draft_head(self.out_dir, self.setup.target)
        return acceptance(trained, self.held, self.opts.max_draft)


def current_head(opts: Options, training: Training, promote: str | None) -> tuple[str, dict]:
    """The head the trained one must beat, and its acceptance: the one in ``--promote-to``,
    else the starting head."""
    from pipeline.engine.draft_head import is_draft_head, load_draft_head

    setup, start_from = training.setup, training.start_from
    if promote and is_draft_head(promote) and (start_from is None
                                               or os.path.realpath(promote) != os.path.realpath(start_from)):
        try:
            cur = load_draft_head(promote, setup.target)
        except ValueError as e:
            raise TrainDrafterError(f"--promote-to {promote!r}: {e}") from None
        layers = list(cur.head_config.feature_layers)
        return promote, acceptance(cur, [held_out_record(setup.target, r, layers, setup.eos_ids)
                                         for r in setup.held_rows], opts.max_draft)
    if promote and start_from is not None:
        return start_from, training.before
    return "the starting head", training.before


def build_report(opts: Options, job: JobOutput, training: Training, after: dict, current: str, current_acc: dict,
                 t_start: float) -> dict:
    """``report.json``'s content (``promoted_to`` set by the caller)."""
    setup, st, K = training.setup, training.st, opts.max_draft
    held = training.held
    better = score(after, K) > score(current_acc, K)
    return {
        "from": job.uri, "target": setup.models.target, "started_from": training.start_from or "a new head",
        "rows": {"committed": len(job.rows), "used": len(setup.rows), "trained_on": len(setup.train_rows),
                 "held_back": len(setup.held_rows), "left_out": setup.skipped,
                 "uncommitted_files_not_read": len(job.uncommitted_files),
                 "answers_retokenized_exactly": sum(r.exact_answer for r in setup.rows),
                 "answers_from_token_ids": sum(r.from_ids for r in setup.rows),
                 "held_back_answer_tokens_equal_to_the_targets_argmax":
                     round(sum(h.argmax_agrees for h in held) / max(1, sum(h.answer_tokens for h in held)), 4)},
        "training": {"steps": st["step"], "epochs": st["epoch"], "rows_seen": st["rows_seen"],
                     "seconds": round(st["seconds"], 1), "lr": opts.lr, "tokens_per_step": opts.tokens_per_step,
                     "final_loss": round(statistics.mean(st["losses"][-10:]), 4) if st["losses"] else None},
        "acceptance": {"method": "teacher-forced greedy drafts against the answer tokens, every block start",
                       "max_draft": K, "before": training.before, "after": after,
                       **({"current": {"head": current, **current_acc}} if current_acc is not training.before
                          else {})},
        "better": "trained" if better else "current",
        "compared": {"mean_accepted_length_at_k": K, "trained": score(after, K), "current": score(current_acc, K),
                     "current_head": current},
        "promoted_to": None, "seconds": round(time.time() - t_start, 1),
    }


def run(opts: Options) -> dict:
    """Run the job (see the module docstring); returns the report.

    Raises:
        TrainDrafterError, ModelError, ConfigError, OutputError: bad input, before training.
    """
    t_start = time.time()
    out_dir, promote = check_options(opts)
    job = read_job_output(opts.source, opts.storage_options, opts.config, opts.max_rows)
    setup = prepare(opts, job)
    training = Training(opts, setup, job, out_dir)
    training.train()
    after = training.save_trained(job)
    current, current_acc = current_head(opts, training, promote)
    report = build_report(opts, job, training, after, current, current_acc, t_start)
    _save_json(os.path.join(out_dir, REPORT), report)
    if promote and report["better"] == "trained":
        write_head_files(out_dir, promote)
        report["promoted_to"] = promote
        _save_json(os.path.join(out_dir, REPORT), report)
        _save_json(os.path.join(promote, REPORT), report)
    return report
