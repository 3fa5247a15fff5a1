"""The names of an output folder: which files are the job's (one place for that question).

Layout of an output directory (``output.uri``, or ``output.uri/date=YYYY-MM-DD`` with
``output.partition_by_date``; any fsspec URL: local path, ``s3://bucket/prefix``...)::

    <dir>/part-00000-u00000.<run>.parquet          unit 0 of input shard 0, written by run <run> (OUTPUT_SCHEMA,
                                                   in the unit's row order)
    <dir>/part-00000-u00001.<run>.00000.parquet    a unit of more than output.max_rows_per_file rows is
    <dir>/part-00000-u00001.<run>.00001.parquet    written as several files, in row order
    <dir>/_manifest/log/0000000000.json            the commit log: a run's start (its epoch), each unit's
    <dir>/_manifest/log/0000000001.json            commit, a run's end; each record created once, never
                                                   overwritten (pipeline.output.commit_log)
    <dir>/_summary.json                            the run summary over all committed units (pipeline.summary)
    <dir>/_SUCCESS                                 written last: every unit of the input is committed
    <dir>/_staging/<run>/                          files of a run in progress, before they are published
    <dir>/_lease.json                              the lease of the run writing the folder now (pipeline.output.lease)

A *unit* is one input shard (file) and one split of it (``input.split_rows`` rows:
:class:`pipeline.units.Unit`); its part name is ``part-<shard>-u<split>.parquet``
(:func:`pipeline.units.part_name`, the one owner of the part names), and its data
files carry the id of the run that wrote them (:func:`data_file_names`), so two runs never
write the same name.  Outputs of earlier versions have untagged data files
(``part-00000-u00000.parquet``, ``part-00000-u00000-00001.parquet``), one manifest entry per
unit (``_manifest/part-00000-u00000.json``) and publish intents (``_manifest/pending/``); and
outputs written before units existed have one part per shard, ``part-<shard>.parquet``
(*whole-shard* parts).  These are still the job's files, and a run resumes them
(:mod:`pipeline.output.resume`).

Files the job owns, and the only ones it ever deletes or overwrites: the data files named
by a committed unit or a publish intent, its *orphans* (data files carrying the id of a run
of this output's commit log that no committed unit names: a run that died or lost its
lease published them), the commit log, the manifest entries and intents of earlier
versions (:data:`ENTRY_FILE`, :data:`INTENT_FILE`), the files of its staging layout
(:data:`STAGED_FILE`), its lease, and ``_summary.json`` / ``_SUCCESS`` of a directory that
has a manifest (:func:`owned_layout_file`, :func:`owned_output_file`).  Anything else is
*foreign* (:mod:`pipeline.output.location`).
"""

from __future__ import annotations

import posixpath
import re
import uuid

from pipeline.units import PART_PATTERN

SUCCESS = "_SUCCESS"
SUMMARY = "_summary.json"
STAGING = "_staging"
MANIFEST = "_manifest"
PENDING = "pending"  # under _manifest/ (publish intents of earlier versions)
LOG = "log"  # under _manifest/: the commit log
#: the lease file, directly in the output folder
LEASE = "_lease.json"

_PART = PART_PATTERN
#: a run id as it appears in names (the writer's ids are 12 hex digits)
RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}", re.ASCII)
#: data files a run writes: ``part-00003-u00002.<run>.parquet``, ``part-00003-u00002.<run>.00001.parquet``
#: (groups: part stem, run id, file index or None)
TAGGED_DATA_FILE = re.compile(r"(" + _PART + r")\.([A-Za-z0-9_-]{1,64})(?:\.(\d{5,}))?\.parquet", re.ASCII)
#: names of data files the job writes, tagged or of earlier versions; a foreign file with such a name is
#: always refused
DATA_FILE = re.compile(r"^part-\d{5,}(-u\d{5,})?((-\d{5,})?|\.[A-Za-z0-9_-]{1,64}(\.\d{5,})?)\.parquet$",
                       re.ASCII)  # ASCII digits only, here and below
#: a manifest entry, ``_manifest/<name>`` (groups: shard, split or None)
ENTRY_FILE = re.compile(_PART + r"\.json", re.ASCII)
#: a publish intent, ``_manifest/pending/<name>`` (groups: shard, split or None, run id)
INTENT_FILE = re.compile(_PART + r"\.([A-Za-z0-9_-]+)\.json", re.ASCII)
#: a record of the commit log, ``_manifest/log/<this>`` (group: its sequence number)
LOG_RECORD = re.compile(r"(\d{10,})\.json", re.ASCII)
#: what a run stages, ``_staging/<this>``: its units' fragments, its markers before they are published,
#: the write probe (and the staged manifest entries of earlier versions)
STAGED_FILE = re.compile(r"[A-Za-z0-9_-]+/(part-\d{5,}(-u\d{5,})?/\d{5,}(-[0-9a-f]{1,32})?\.parquet"
                         r"|part-\d{5,}(-u\d{5,})?\.parquet\.json|\.probe|_SUCCESS|_summary\.json)", re.ASCII)
#: the temporary name a small file of the job is written under before its rename
#: (:meth:`~pipeline.output.location.OutputLocation.put_atomic`): ``.<name>.<32 hex digits>.tmp`` beside it
TEMP_FILE = re.compile(r"\.(.+)\.[0-9a-f]{32}\.tmp", re.ASCII)


def temp_name(path: str) -> str:
    """Where :meth:`~pipeline.output.location.OutputLocation.put_atomic` writes ``path``
    before renaming it: a hidden name of :data:`TEMP_FILE` in the same folder (so the
    rename is atomic)."""
    folder, name = posixpath.split(path)
    return posixpath.join(folder, f".{name}.{uuid.uuid4().hex}.tmp")


def entry_name(part: str) -> str:
    """The manifest file of a part: ``part-00003-u00002.json``."""
    return part[: -len(".parquet")] + ".json"


def data_file_names(part: str, n_files: int, run_id: str | None = None) -> list[str]:
    """Final names of a part's data files, in row order.  Written by run ``run_id``:
    ``[part-00003-u00002.<run>.parquet]`` for one file, else ``part-00003-u00002.<run>.00000.parquet``,
    ``...<run>.00001.parquet``, ...; ``run_id=None``: the untagged names of earlier versions
    (``part-00003-u00002.parquet``, ``part-00003-u00002-00000.parquet``, ...)."""
    stem = part[: -len(".parquet")]
    if run_id is not None:
        if not RUN_ID.fullmatch(run_id):
            raise ValueError(f"a run id in names is 1-64 letters, digits, '_' or '-', got {run_id!r}")
        return [f"{stem}.{run_id}.parquet"] if n_files <= 1 else \
            [f"{stem}.{run_id}.{c:05d}.parquet" for c in range(n_files)]
    if n_files <= 1:
        return [part]
    return [f"{stem}-{c:05d}.parquet" for c in range(n_files)]


def data_file_run(name: str) -> str | None:
    """The run id a data file's name carries (``part-00003-u00002.<run>.parquet`` -> ``<run>``);
    None for the untagged names of earlier versions and for other names."""
    m = TAGGED_DATA_FILE.fullmatch(name)
    return m.group(4) if m else None


def log_record(seq: int) -> str:
    """The commit log's record ``seq``, relative to the output folder: ``_manifest/log/0000000007.json``."""
    return posixpath.join(MANIFEST, LOG, f"{seq:010d}.json")


def owned_layout_file(rel: str) -> bool:
    """Whether ``rel`` (a path relative to the output folder) is a file of this job's own
    layout under ``_manifest/`` or ``_staging/``, its lease, or the temporary name of one of
    its small files (``_manifest/pending/.part-00000-u00000.<run>.json.<hex>.tmp``,
    ``._SUCCESS.<hex>.tmp``: a run killed between the write and the rename leaves it)."""
    if rel == LEASE:
        return True
    folder, name = posixpath.split(rel)
    tmp = TEMP_FILE.fullmatch(name)
    if tmp:
        meant = posixpath.join(folder, tmp.group(1))
        return meant in (SUCCESS, SUMMARY) or (meant != LEASE and owned_layout_file(meant))
    top, _, rest = rel.partition("/")
    if top == MANIFEST:
        sub, _, name = rest.partition("/")
        return bool(ENTRY_FILE.fullmatch(rest) or (sub == PENDING and INTENT_FILE.fullmatch(name))
                    or (sub == LOG and LOG_RECORD.fullmatch(name)))
    return top == STAGING and bool(STAGED_FILE.fullmatch(rest))


def owned_output_path(rel: str) -> bool:
    """Whether a path relative to an output's root folder names one of the job's files
    (:func:`owned_output_file`) or its ``_manifest/`` or ``_staging/`` folder (in the folder
    or a ``date=`` partition), or lies in one."""
    return any(d in (MANIFEST, STAGING) for d in rel.strip("/").split("/")) or owned_output_file(rel)


def owned_output_file(rel: str) -> bool:
    """Whether a path relative to an output's root folder (``output.uri``) names one of the
    job's files there: under ``_manifest/`` or ``_staging/``, a marker or the lease, or a
    data file (in the folder or a ``date=`` partition).  The input listing leaves such
    files out (:meth:`pipeline.output.location.OutputLocation.contains`)."""
    parts = rel.strip("/").split("/")
    if any(d in (MANIFEST, STAGING) for d in parts[:-1]):
        return True
    folders = parts[:-1]
    mine = not folders or (len(folders) == 1 and folders[0].startswith("date="))
    return mine and (parts[-1] in (SUCCESS, SUMMARY, LEASE) or bool(DATA_FILE.match(parts[-1])))
