"""Nightly reuse: a row is copied from a previous output of the job, not decoded, when nothing
that shapes its output changed (``output.previous``, ``--previous``).

Keys.  Every row a run decodes carries a ``reuse_key`` (:func:`row_reuse_key`, 32 hex digits
of a SHA-256) over what its output depends on:

- the run's reuse fingerprint (:func:`pipeline.fingerprint.reuse_fingerprint`: the model's
  and the tokenizer's whole-file hashes, the task with its templates, the generation settings;
  the method and its drafter only where they shape the tokens: sampling, or a lossy static
  ensemble), computed once in the driver;
- the row's prompt token ids (what the template, the chat template and the text make);
- sampling, the row's own seed (:func:`pipeline.loading.row_settings`: the job's seed and the
  row's id, so a sampled row whose id changed is decoded again); a greedy row has no seed
  in its key, so a row whose id or file changed is still reused; sampling without a seed
  gives no key (each run draws afresh);
- the generation settings a row of the processor sets for itself (``max_new_tokens``,
  ``stop``), where they differ from the job's.

Where.  The driver resolves ``output.previous`` before any work (:func:`plan_reuse`: ``auto``
is :func:`pipeline.output.reader.previous_partition` of ``output.uri`` before the run's date;
a folder that is not a job output is refused, naming it), then reads the previous output's
committed rows once per run, in a Ray task (:func:`share_previous`, so the driver's memory
stays flat), through the one reader of committed output
(:class:`~pipeline.output.reader.CommittedOutput`: a killed run's files are never read).  The
task returns a :class:`ReuseTable`: numpy arrays only (the keys as two ``uint64`` columns
sorted together, the output token ids flat with offsets, finish reasons and origins as
codes, row-id hashes sorted for :meth:`ReuseTable.reference_for`), which Ray keeps in its
object store once per node and every actor maps without a copy.  Each actor
(:class:`RowReuse`) looks a row's key up by binary search (``numpy.searchsorted``):
``O(log n)`` per row, 45 bytes per previous row (its key, offset, codes and id hash) and 4
per output token, whatever the number of actors on a node.

What is copied is checked first (:func:`read_previous`): each committed data file against its
unit record's SHA-256, size and rows (a file that fails is named, its rows decoded afresh and
counted in ``previous.rejected_rows``), each row's key for its form and its token ids against
the target's vocabulary before they are narrowed to ``int32``; an output written before
checksums is read unverified (``previous.unverified_files``).  ``output.previous`` naming this
run's own folder by any spelling (a link, ``.``, ``..``) is refused in the preflight
(:func:`pipeline.storage.same_location`), before ``overwrite`` could delete anything.

A reused row's output is the previous row's token ids, their text decoded again by this
run's tokenizer (the same files), its finish reason, and ``reused_from``
(``<previous output>#<run id>``, the run that committed it there).  Its decode statistics are
null (nothing was decoded: no steps, no times; ``prompt_tokens`` and ``new_tokens`` are
given), so tokens/s and every rate count the decoded rows only; the summary counts
``reused_rows`` apart (:mod:`pipeline.summary`).  The lossless audit re-decodes its fraction
of reused rows with plain decoding and compares the token ids, as for decoded rows.

The persisted draft pool.  The previous output is also the job-wide draft pool a method that
learns from finished outputs keeps (suffix decoding's tree of earlier outputs,
:attr:`~pipeline.engine.methods.MethodSpec.learns_from_outputs`): each actor seeds it, after
its warm-up's reset, with the output token ids of up to the pool's bound
(:meth:`~pipeline.engine.methods.MethodSpec.pool_size`, from the method's ``Params``) of
previous rows (:meth:`RowReuse.pool_documents`, :meth:`pipeline.engine.loop.StepEngine.seed_pool`;
counted in the summary's ``previous.pool_seeded_rows``).  It is keyed to the model and the
tokenizer (:func:`pipeline.fingerprint.model_and_tokenizer`), not to the whole config: a
previous output decoded with another generation setting still seeds the pool (its rows are
then neither copied nor drafted from as references), one decoded with another model or
tokenizer is refused in one log line naming the folder and which of the two differs, and the
run goes on without it.  Drafts only: the output is the same with or without the pool.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.config import ConfigError, JobConfig
from pipeline.fingerprint import describe_changes, model_and_tokenizer, reuse_fingerprint, reuse_identity

log = logging.getLogger("specbatch")

#: the previous output's columns the table is built from (and the reader's provenance)
READ_COLUMNS = ["reuse_key", "id", "output_token_ids", "finish_reason", "error"]


# ---------------------------------------------------------------------------- keys
def row_reuse_key(fingerprint: str, prompt_ids: Iterable[int], settings: Any, job_settings: Any = None) -> str | None:
    """A row's reuse key: 32 hex digits (128 bits) of the SHA-256 of the run's reuse
    fingerprint, the prompt token ids (int64 little-endian), when sampling the row's seed,
    and the settings the row sets apart from ``job_settings`` (see the module docstring).

    Args:
        fingerprint: :func:`pipeline.fingerprint.reuse_fingerprint` of the run.
        prompt_ids: the row's prompt token ids.
        settings: the row's :class:`pipeline.engine.GenerationSettings` (its seed derived).
        job_settings: the job's settings (None: the row sets nothing of its own).

    Returns:
        The key, or None when the row samples without a seed (no output to reuse).
    """
    if settings.do_sample and settings.seed is None:
        return None
    h = hashlib.sha256(fingerprint.encode())
    h.update(b"\x00ids\x00" + np.asarray(list(prompt_ids), dtype="<i8").tobytes())
    if settings.do_sample:
        h.update(f"\x00seed\x00{settings.seed}".encode())
    if job_settings is not None:
        own = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)
               if f.name != "seed" and getattr(settings, f.name) != getattr(job_settings, f.name)}
        if own:
            h.update(b"\x00own\x00" + json.dumps(own, sort_keys=True, default=str).encode())
    return h.hexdigest()[:32]


def _split_key(key: str) -> tuple[int, int]:
    """A key's two 64-bit halves (big-endian: the order of the hex string)."""
    return int(key[:16], 16), int(key[16:32], 16)


def _id_hash(row_id: Any) -> int:
    return int.from_bytes(hashlib.sha256(str(row_id).encode()).digest()[:8], "big")


# ---------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class Reused:
    """A previous row's output, as a reused row takes it."""

    token_ids: list[int]
    finish_reason: str | None
    reused_from: str


@dataclass
class ReuseTable:
    """The previous output's reusable rows, as numpy arrays (shared zero-copy through Ray's
    object store).  Rows are in key order; build one with :meth:`from_batches`.

    Attributes:
        key_hi, key_lo: ``uint64`` halves of each row's reuse key, sorted by ``(hi, lo)``.
        offsets: ``int64`` (rows + 1): row ``i``'s output ids are ``tokens[offsets[i]:offsets[i+1]]``.
        tokens: ``int32``, every row's output token ids, flat.
        finish, finish_names: ``uint8`` codes of each row's finish reason, and the names.
        origin, origin_names: ``int32`` codes of each row's ``reused_from``, and the names.
        id_hash, id_row: ``uint64`` 64-bit hashes of the rows' ids, sorted, and the row of each.
    """

    key_hi: np.ndarray
    key_lo: np.ndarray
    offsets: np.ndarray
    tokens: np.ndarray
    finish: np.ndarray
    finish_names: list[str | None]
    origin: np.ndarray
    origin_names: list[str]
    id_hash: np.ndarray
    id_row: np.ndarray

    def __len__(self) -> int:
        return len(self.key_hi)

    @property
    def nbytes(self) -> int:
        """Bytes of its arrays."""
        return sum(getattr(self, f.name).nbytes for f in dataclasses.fields(self)
                   if isinstance(getattr(self, f.name), np.ndarray))

    def find(self, key: str | None) -> int | None:
        """The row holding reuse key ``key`` (the first of equal ones), or None."""
        if key is None or not len(self):
            return None
        hi, lo = (np.array([v], dtype=np.uint64) for v in _split_key(key))
        start, stop = (int(x) for x in (np.searchsorted(self.key_hi, hi, "left")[0],
                                        np.searchsorted(self.key_hi, hi, "right")[0]))
        if start == stop:
            return None
        at = start + int(np.searchsorted(self.key_lo[start:stop], lo, "left")[0])
        return at if at < stop and self.key_lo[at] == lo[0] else None

    def output(self, row: int) -> Reused:
        """Row ``row``'s output."""
        ids = self.tokens[self.offsets[row]:self.offsets[row + 1]].tolist()
        return Reused(ids, self.finish_names[self.finish[row]], self.origin_names[self.origin[row]])

    def reference_for(self, row_id: Any) -> list[int] | None:
        """The previous output's token ids of the row whose id is ``row_id`` (its prompt may
        have changed: the reference a draft can copy from), or None when the previous output
        has no reusable row of that id.  Ids are matched by a 64-bit hash: a collision gives
        another row's output, which only costs a draft's acceptance.  An id held by several
        previous rows gives the first in key order."""
        if row_id is None or not len(self.id_hash):
            return None
        h = np.array([_id_hash(row_id)], dtype=np.uint64)
        at = int(np.searchsorted(self.id_hash, h, "left")[0])
        if at >= len(self.id_hash) or self.id_hash[at] != h[0]:
            return None
        return self.output(int(self.id_row[at])).token_ids

    @classmethod
    def from_batches(cls, batches: Iterable[pa.RecordBatch], origin_of: Any,
                     vocab_size: int | None = None) -> tuple["ReuseTable", dict[str, Any]]:
        """The table of the rows of ``batches`` (columns :data:`READ_COLUMNS` and the reader's
        run column) that can be reused: no error, a well-formed key and output ids, each
        id in ``[0, vocab_size)`` (checked before the ids are narrowed to ``int32``).

        Args:
            batches: record batches of a previous output, in any order.
            origin_of: ``run id -> reused_from`` value.
            vocab_size: the target's vocabulary size (None: ids must fit ``int32``).

        Returns:
            ``(table, counts)``: counts of ``rows`` read and of ``usable`` ones; ``keyless``:
            rows without error that carry no key (an output written before keys existed, or
            sampled without a seed); ``rejected_rows``: rows with error-free output that are
            not copied (a malformed key, ids outside the vocabulary), and ``rejected``:
            reason -> rows.
        """
        from pipeline.output.reader import RUN_COLUMN

        parts: dict[str, list[np.ndarray]] = {k: [] for k in ("hi", "lo", "len", "tok", "fin", "org", "idh")}
        finish_names: dict[str | None, int] = {}
        origin_names: dict[str, int] = {}
        counts: dict[str, Any] = {"rows": 0, "usable": 0, "keyless": 0, "rejected_rows": 0, "rejected": {}}
        bound = int(vocab_size) if vocab_size is not None else 2**31
        for b in batches:
            counts["rows"] += b.num_rows
            ok = pc.is_null(b.column("error"))
            counts["keyless"] += int(pc.sum(pc.and_(ok, pc.is_null(b.column("reuse_key")))).as_py() or 0)
            keep = pc.and_(ok, pc.and_(pc.is_valid(b.column("reuse_key")), pc.is_valid(b.column("output_token_ids"))))
            b = b.filter(keep)
            if not b.num_rows:
                continue
            b = _reject(b, pc.invert(pc.match_substring_regex(b.column("reuse_key"), r"^[0-9a-f]{32}$")),
                        "a malformed reuse key (not 32 lower-case hex digits)", counts)
            b = _reject(b, _ids_outside(b.column("output_token_ids"), bound),
                        f"output token ids outside the target's vocabulary (size {bound})", counts)
            if not b.num_rows:
                continue
            counts["usable"] += b.num_rows
            keys = np.frombuffer(bytes.fromhex("".join(b.column("reuse_key").to_pylist())), dtype=">u8").reshape(-1, 2)
            parts["hi"].append(keys[:, 0].astype(np.uint64))
            parts["lo"].append(keys[:, 1].astype(np.uint64))
            ids = b.column("output_token_ids")
            parts["len"].append(pc.list_value_length(ids).to_numpy(zero_copy_only=False).astype(np.int64))
            parts["tok"].append(pc.list_flatten(ids).to_numpy(zero_copy_only=False).astype(np.int32))
            parts["fin"].append(np.array([finish_names.setdefault(r, len(finish_names))
                                          for r in b.column("finish_reason").to_pylist()], dtype=np.uint8))
            parts["org"].append(np.array([origin_names.setdefault(origin_of(r), len(origin_names))
                                          for r in b.column(RUN_COLUMN).to_pylist()], dtype=np.int32))
            parts["idh"].append(np.array([_id_hash(i) for i in b.column("id").to_pylist()], dtype=np.uint64))
        joined = {k: np.concatenate(v) if v else np.zeros(0, dtype=_DTYPES[k]) for k, v in parts.items()}
        return cls._sorted(joined, list(finish_names), list(origin_names)), counts

    @classmethod
    def _sorted(cls, a: dict[str, np.ndarray], finish_names: list, origin_names: list) -> "ReuseTable":
        """The table of the gathered arrays ``a``, its rows in key order."""
        order = np.lexsort((a["lo"], a["hi"]))
        lengths = a["len"][order]
        starts = (np.cumsum(a["len"]) - a["len"])[order]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        gather = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1], dtype=np.int64)
        idh = a["idh"][order]
        by_id = np.argsort(idh, kind="stable")
        return cls(key_hi=a["hi"][order], key_lo=a["lo"][order], offsets=offsets, tokens=a["tok"][gather],
                   finish=a["fin"][order], finish_names=finish_names, origin=a["org"][order],
                   origin_names=origin_names, id_hash=idh[by_id], id_row=by_id.astype(np.int64))


def _ids_outside(ids: pa.ChunkedArray | pa.Array, bound: int) -> np.ndarray:
    """Per row of the list column ``ids``: whether one of its ids is outside ``[0, bound)``
    (read as int64: nothing narrowed before the check)."""
    ids = ids.combine_chunks() if isinstance(ids, pa.ChunkedArray) else ids
    flat = pc.list_flatten(ids).to_numpy(zero_copy_only=False).astype(np.int64)
    bad = np.zeros(len(ids), dtype=bool)
    out = (flat < 0) | (flat >= bound)
    if out.any():
        bad[pc.list_parent_indices(ids).to_numpy(zero_copy_only=False)[out]] = True
    return bad


def _reject(b: pa.RecordBatch, bad: Any, reason: str, counts: dict[str, Any]) -> pa.RecordBatch:
    """``b`` without the rows where ``bad`` (a boolean mask; nulls count as bad), counted
    under ``reason`` in ``counts``."""
    bad = np.asarray(pc.fill_null(bad, True) if isinstance(bad, (pa.Array, pa.ChunkedArray)) else bad, dtype=bool)
    n = int(bad.sum())
    if not n:
        return b
    counts["rejected_rows"] += n
    counts["rejected"][reason] = counts["rejected"].get(reason, 0) + n
    return b.filter(pa.array(~bad))


_DTYPES = {"hi": np.uint64, "lo": np.uint64, "len": np.int64, "tok": np.int32, "fin": np.uint8, "org": np.int32,
           "idh": np.uint64}


def read_previous(url: str, storage_options: dict[str, Any] | None = None, retry: Any = None,
                  vocab_size: int | None = None) -> tuple[ReuseTable, dict[str, Any]]:
    """The :class:`ReuseTable` of the committed rows of the job output ``url`` (read through
    :class:`~pipeline.output.reader.CommittedOutput`, batch by batch, each data file checked
    against its record), and its counts (:meth:`ReuseTable.from_batches`'s, plus
    ``unverified_files``: files of a version before checksums, decoded but not hashed).

    A data file that fails its check (missing, cut short, replaced, not Parquet) is named in
    one log line; its rows are left out of the table (decoded afresh) and counted in
    ``rejected_rows`` under ``rejected``'s reason ``<file>: <what failed>``.  The same
    table seeds the job-wide draft pool: rejected rows seed nothing.

    Raises:
        OutputReadError: ``url`` is not a job output or mixes configs.
        StorageError: the storage kept failing with transient errors.
    """
    from pipeline.output.reader import CommittedOutput

    out = CommittedOutput.open(url, storage_options, retry)
    damaged: list[Any] = []

    def on_damaged(e: Any) -> None:
        log.warning("output.previous: %s: its %s row(s) are not copied, they are decoded afresh", e,
                    "?" if e.rows is None else e.rows)
        damaged.append(e)

    table, counts = ReuseTable.from_batches(out.batches(READ_COLUMNS, on_damaged=on_damaged),
                                            lambda run: f"{out.url}#{run}", vocab_size)
    for e in damaged:
        reason = f"{e.name}: {e.reason}"
        counts["rejected_rows"] += e.rows or 0
        counts["rejected"][reason] = counts["rejected"].get(reason, 0) + (e.rows or 0)
    counts["unverified_files"] = len(out.unverified)
    return table, counts


# ---------------------------------------------------------------------------- the driver
@dataclass
class ReusePlan:
    """What a run reuses, resolved in the driver before any work.

    Attributes:
        fingerprint: the run's reuse fingerprint (every row's key starts from it).
        previous: the previous output's URL to copy rows from (None: nothing to reuse).
        finished: whether that output is complete (its committed units are read either way).
        note: one line for the log and the summary: what was found, or why nothing is reused.
        pool_from: the previous output whose rows seed each actor's job-wide draft pool (its
            model and tokenizer are this run's; None: no pool to seed, or it was refused).
        pool_size: how many previous rows may seed the pool (the method's bound on it,
            :meth:`MethodSpec.pool_size <pipeline.engine.methods.MethodSpec.pool_size>`; 0: the
            method learns nothing from outputs).
        vocab_size: the target's vocabulary size: a previous row holding an id outside it is
            rejected (None: ids must fit ``int32``).
    """

    fingerprint: str
    previous: str | None = None
    finished: bool | None = None
    note: str | None = None
    counts: dict[str, int] = field(default_factory=dict)
    pool_from: str | None = None
    pool_size: int = 0
    vocab_size: int | None = None

    def facts(self) -> dict[str, Any] | None:
        """The run summary's ``previous``: ``{"output", "finished", "note", "rows", "usable",
        "rejected_rows", "rejected" (reason -> rows), "unverified_files", ...}``,
        None when ``output.previous`` is unset."""
        if self.note is None:
            return None
        return {"output": self.previous, "finished": self.finished, "note": self.note, **self.counts}


def plan_reuse(cfg: JobConfig, identity: dict[str, Any], greedy: bool, own_url: str) -> ReusePlan:
    """Resolve ``output.previous`` (see the module docstring); each outcome is logged in one line.

    Args:
        identity: this run's :func:`pipeline.fingerprint.config_identity`.
        greedy: this run decodes greedily.
        own_url: the folder this run writes (naming it as the previous output is refused).

    Raises:
        OutputReadError: the named folder is not a job output (missing, empty, a file, no
            committed unit, several ``date=`` partitions, mixed configs), each named.
        ConfigError: it is this run's own output folder.
        StorageError: the storage kept failing with transient errors.
    """
    from pipeline.output.reader import CommittedOutput, OutputReadError, previous_partition

    plan = ReusePlan(reuse_fingerprint(identity, greedy), pool_size=pool_size(cfg))
    o = cfg.output
    if o.previous is None:
        return plan
    if o.previous == "auto":
        url = previous_partition(o.uri, o.effective_run_date(), o.storage_options, cfg.retry)
        if url is None:
            plan.note = (f"output.previous: auto: no complete date= partition of {o.uri} before {o.effective_run_date()}"
                         ": nothing to reuse, every row is decoded")
            log.info("%s", plan.note)
            return plan
    else:
        url = o.previous
    try:
        prev = CommittedOutput.open(url, o.storage_options, cfg.retry)
    except OutputReadError as e:
        raise OutputReadError(f"output.previous: {e}") from None
    if _same_folder(prev.location, own_url, o.storage_options, cfg.retry):
        raise ConfigError(f"output.previous ({url}) is this run's own output folder ({own_url}), by another "
                          "spelling or a link: name an earlier output (a rerun of the same output resumes by itself)")
    plan.finished = prev.finished
    plan.pool_from = _pool_source(plan, prev, identity)
    theirs = reuse_fingerprint(prev.config_identity, greedy)
    if theirs != plan.fingerprint:
        changes = describe_changes(reuse_identity(prev.config_identity, greedy), reuse_identity(identity, greedy))
        plan.note = (f"output.previous: {prev.url} was decoded under another config ({changes}): nothing to reuse, "
                     "every row is decoded")
        log.info("%s", plan.note)
        return plan
    plan.previous = prev.url
    state = "finished" if prev.finished else ("unfinished (a run was killed, lost its lease or is in progress): only "
                                              "its committed units are read")
    plan.note = f"output.previous: reusing the unchanged rows of {prev.url}, {prev.rows_committed} committed row(s), {state}"
    log.info("%s", plan.note)
    return plan


def _same_folder(prev: Any, own_url: str, storage_options: dict[str, Any], retry: Any) -> bool:
    """Whether the previous output's location ``prev`` is the folder ``own_url`` by identity
    (:func:`pipeline.storage.same_location`: a real path or the same file on local disk, the
    normalised bucket and key on an object store), not by spelling."""
    from pipeline.config import OutputConfig
    from pipeline.output.location import OutputLocation
    from pipeline.storage import same_location

    own = OutputLocation(OutputConfig(uri=own_url, partition_by_date=False, storage_options=dict(storage_options or {})),
                         retry)
    return same_location(prev.fs, prev.root, own.fs, own.root)


def pool_size(cfg: JobConfig) -> int:
    """How many previous rows seed an actor's job-wide draft pool: the method's bound on the
    pool when it learns from finished outputs, else 0
    (:meth:`MethodSpec.pool_size <pipeline.engine.methods.MethodSpec.pool_size>`)."""
    from pipeline.engine import METHODS

    spec = METHODS.get(cfg.method.name)
    return spec.pool_size(cfg.method.speculation_settings()) if spec is not None else 0


def _pool_source(plan: ReusePlan, prev: Any, identity: dict[str, Any]) -> str | None:
    """The previous output ``prev`` (a :class:`~pipeline.output.reader.CommittedOutput`) when
    its rows may seed the job-wide draft pool: the method keeps one and ``prev`` was decoded
    with this run's model and tokenizer (:func:`pipeline.fingerprint.model_and_tokenizer`).
    Another model or tokenizer is refused in one log line that names the folder and which of
    the two differs (and how); the run goes on without the pool."""
    if plan.pool_size <= 0:
        return None
    mine, theirs = model_and_tokenizer(identity), model_and_tokenizer(prev.config_identity)
    differs = [k for k in ("model", "tokenizer") if mine[k] != theirs[k]]
    if differs:
        files = sorted(f for k in differs for f in set(mine[k]) | set(theirs[k]) if mine[k].get(f) != theirs[k].get(f))
        log.warning("output.previous: the job-wide draft pool of %s is refused: it was decoded with another %s (files "
                    "changed: %s); the run goes on without it", prev.url, " and ".join(differs), ", ".join(files))
        return None
    return prev.url


def share_previous(plan: ReusePlan, cfg: JobConfig) -> dict[str, Any]:
    """The actors' ``reuse`` argument (:class:`RowReuse`): ``{"fingerprint", "table", "copy",
    "pool"}``, ``table`` an ``ObjectRef`` of the previous output's :class:`ReuseTable`, read by
    one Ray task (no CPU reserved: I/O) and kept in the object store, None when there is
    nothing to reuse or seed; ``copy`` whether its rows may be copied and drafted from as
    references (``plan.previous``); ``pool`` how many of them seed each actor's job-wide draft
    pool (``plan.pool_from``: at most ``plan.pool_size``; also the summary's
    ``previous.pool_seeded_rows``).  Needs a running Ray when there is a table to read; waits
    for the table's counts (logged in one line).

    Raises:
        OutputReadError: a committed file of the previous output is missing.
        StorageError: the storage kept failing with transient errors.
    """
    url = plan.previous or plan.pool_from
    if url is None:
        return {"fingerprint": plan.fingerprint, "table": None}
    import ray

    task = ray.remote(num_cpus=0, num_returns=2)(_read_remote)
    table_ref, counts_ref = task.remote(url, cfg.output.storage_options, cfg.retry.model_dump(), plan.vocab_size)
    try:
        plan.counts = ray.get(counts_ref)
    except ray.exceptions.RayTaskError as e:  # our own error, raised in the task: as it was
        try:  # the table's result holds the same error: fetched, so Ray prints no "Unhandled error" for it
            ray.get(table_ref)
        except Exception:  # noqa: BLE001 - the same failure, reported once below
            pass
        cause = getattr(e, "cause", None)
        if isinstance(cause, Exception):
            raise cause from None
        raise
    c = plan.counts
    pool = min(c["usable"], plan.pool_size) if plan.pool_from else 0
    c["pool_seeded_rows"] = pool
    if c.get("rejected_rows"):
        log.warning("output.previous: %d row(s) of %s are not copied and decoded afresh: %s", c["rejected_rows"], url,
                    "; ".join(f"{n} {why}" for why, n in c["rejected"].items()))
    if pool:
        log.info("output.previous: %d committed row(s) of %s seed each actor's job-wide draft pool", pool, url)
    if plan.previous is None:
        pass
    elif c["usable"]:
        log.info("output.previous: %d of the %d committed rows of %s can be copied (%.1f MB shared with the actors)",
                 c["usable"], c["rows"], plan.previous, c["nbytes"] / 2**20)
    else:
        why = (" (written by a version before reuse keys, or sampled without a seed)" if c["keyless"] else "")
        log.info("output.previous: no row of %s carries a reuse key%s: nothing to reuse, every row is decoded",
                 plan.previous, why)
        plan.note += "; no row carries a reuse key: nothing reused"
    return {"fingerprint": plan.fingerprint, "table": table_ref if c["usable"] else None,
            "copy": plan.previous is not None, "pool": pool}


def _read_remote(url: str, storage_options: dict[str, Any], retry: dict[str, Any], vocab_size: int | None = None):
    table, counts = read_previous(url, storage_options, retry, vocab_size)
    return table, {**counts, "nbytes": table.nbytes}


# ---------------------------------------------------------------------------- the actor
class RowReuse:
    """An actor's side of reuse: the run's fingerprint (each row's key) and the previous
    rows, fetched from the object store at the first look-up (once per actor; no copy).

    Args:
        fingerprint: the run's reuse fingerprint.
        table: a :class:`ReuseTable`, an ``ObjectRef`` of one, or None (keys only: nothing to copy).
        copy: whether the table's rows are copied and drafted from as references (False: they
            only seed the job-wide draft pool, the previous output having another config).
        pool: how many of the table's rows seed the job-wide draft pool (:meth:`pool_documents`).
    """

    def __init__(self, fingerprint: str, table: Any = None, copy: bool = True, pool: int = 0):
        self.fingerprint = fingerprint
        self._table = table
        self.copy = copy
        self.pool = pool

    @classmethod
    def of(cls, arg: dict[str, Any] | None) -> "RowReuse | None":
        """From :func:`share_previous`'s plain data (None: the caller computes no keys)."""
        return None if not arg else cls(arg["fingerprint"], arg.get("table"), arg.get("copy", True), arg.get("pool", 0))

    @property
    def table(self) -> ReuseTable | None:
        if self._table is not None and not isinstance(self._table, ReuseTable):
            import ray

            self._table = ray.get(self._table)
        return self._table

    def key(self, prompt_ids: list[int], settings: Any, job_settings: Any) -> str | None:
        """:func:`row_reuse_key` of a row under this run's fingerprint."""
        return row_reuse_key(self.fingerprint, prompt_ids, settings, job_settings)

    def find(self, key: str | None) -> Reused | None:
        """The previous output of the row with reuse key ``key``, or None."""
        table = self.table if self.copy else None
        row = table.find(key) if table is not None else None
        return table.output(row) if row is not None else None

    def reference_for(self, row_id: Any) -> list[int] | None:
        """:meth:`ReuseTable.reference_for` (None without a previous output)."""
        table = self.table if self.copy else None
        return table.reference_for(row_id) if table is not None else None

    def pool_documents(self) -> list[list[int]]:
        """The output token ids of the previous rows that seed the job-wide draft pool: the last
        ``pool`` rows of the table (in its key order: a deterministic sample, as good as any,
        the previous output recording no order of completion); ``[]`` without a table."""
        table = self.table if self.pool > 0 else None
        if table is None:
            return []
        return [table.output(r).token_ids for r in range(max(0, len(table) - self.pool), len(table))]
