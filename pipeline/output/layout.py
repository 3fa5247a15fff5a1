"""The names of an output folder: which files are the job's (one place for that question).

Layout of an output directory (``output.uri``, or ``output.uri/date=YYYY-MM-DD`` with
``output.partition_by_date``; any fsspec URL: local path, ``s3://bucket/prefix``...)::

    <dir>/part-00000-u00000.parquet          unit 0 of input shard 0 (OUTPUT_SCHEMA, in the unit's row order)
    <dir>/part-00000-u00001-00000.parquet    a unit of more than output.max_rows_per_file rows is
    <dir>/part-00000-u00001-00001.parquet    written as several files, in row order
    <dir>/_manifest/part-00000-u00000.json   the unit's commit record (pipeline.output.writer)
    <dir>/_manifest/pending/...              publish intents (pipeline.output.writer)
    <dir>/_summary.json                      the run summary over all committed units (pipeline.summary)
    <dir>/_SUCCESS                           written last: every unit of the input is committed
    <dir>/_staging/<run_id>/                 files of a run in progress, before they are published
    <dir>/_lease.json                        the lease of the run writing the folder now (pipeline.output.lease)

A *unit* is one input shard (file) and one split of it (``input.split_rows`` rows:
:class:`pipeline.input.units.Unit`); its part name is ``part-<shard>-u<split>.parquet``
(:func:`pipeline.input.units.part_name`, the one owner of the part names).  Outputs
written before units existed have one part per shard, ``part-<shard>.parquet`` (and
``part-<shard>-NNNNN.parquet`` when split into files): these *whole-shard* parts are still
the job's files, and a run resumes them (:mod:`pipeline.output.resume`).

Files the job owns, and the only ones it ever deletes or overwrites: the data files named
by a manifest entry or a publish intent, the manifest entries and intents themselves
(:data:`ENTRY_FILE`, :data:`INTENT_FILE`), the files of its staging layout
(:data:`STAGED_FILE`), its lease, and ``_summary.json`` / ``_SUCCESS`` of a directory that
has a manifest (:func:`owned_layout_file`, :func:`owned_output_file`).  Anything else is
*foreign* (:mod:`pipeline.output.location`).
"""

from __future__ import annotations

import posixpath
import re
import uuid

from pipeline.input.units import PART_PATTERN, parse_part, part_name  # noqa: F401 (the units' names; re-exported)

SUCCESS = "_SUCCESS"
SUMMARY = "_summary.json"
STAGING = "_staging"
MANIFEST = "_manifest"
PENDING = "pending"  # under _manifest/
#: the lease file, directly in the output folder
LEASE = "_lease.json"

_PART = PART_PATTERN
#: names of data files the job writes; a foreign file with such a name is always refused
DATA_FILE = re.compile(r"^part-\d{5,}(-u\d{5,})?(-\d{5,})?\.parquet$", re.ASCII)  # ASCII digits only, here and below
#: a manifest entry, ``_manifest/<name>`` (groups: shard, split or None)
ENTRY_FILE = re.compile(_PART + r"\.json", re.ASCII)
#: a publish intent, ``_manifest/pending/<name>`` (groups: shard, split or None, run id)
INTENT_FILE = re.compile(_PART + r"\.([A-Za-z0-9_-]+)\.json", re.ASCII)
#: what a run stages, ``_staging/<this>``: its units' fragments, manifest entries, write probe
STAGED_FILE = re.compile(r"[A-Za-z0-9_-]+/(part-\d{5,}(-u\d{5,})?/\d{5,}(-[0-9a-f]{1,32})?\.parquet"
                         r"|part-\d{5,}(-u\d{5,})?\.parquet\.json|\.probe)", re.ASCII)
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


def data_file_names(part: str, n_files: int) -> list[str]:
    """Final names of a part's data files: ``[part-00003-u00002.parquet]`` for one file, else
    ``part-00003-u00002-00000.parquet``, ``...-00001.parquet``, ... (row order)."""
    if n_files <= 1:
        return [part]
    stem = part[: -len(".parquet")]
    return [f"{stem}-{c:05d}.parquet" for c in range(n_files)]


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
        return bool(ENTRY_FILE.fullmatch(rest) or (sub == PENDING and INTENT_FILE.fullmatch(name)))
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
