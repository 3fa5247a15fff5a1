"""Work units: an input file (a *shard*) and a split of it, and their names.

A job reads, decodes, commits and resumes in units: one input shard and one split of at
most ``input.split_rows`` rows (:class:`Split`: Parquet row groups merged up to that,
JSONL line ranges).  :func:`pipeline.input.discovery.resolve_shards` finds each file's
splits in the driver before any model loads; the read stage reads one unit per task
(:func:`pipeline.input.rows.read_unit`); the writer commits each unit under its part name
(:attr:`Unit.part`).

This module owns the names of units: the part name (:func:`part_name`,
``part-<shard>-u<split>.parquet``, which the output's data files and manifest entries are
named after: :mod:`pipeline.layout`) and the column that carries each row's part
name from the read stage to the write stage (:data:`UNIT_COLUMN`).
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import asdict, dataclass
from typing import Any

#: the column of the read stage's rows naming each row's unit (its part name); the write
#: stage groups by it (:mod:`pipeline.output.sink`) and drops it
UNIT_COLUMN = "_unit"
#: a part name without its ``.parquet``: groups shard, split (None: a whole-shard part of
#: the layout before units)
PART_PATTERN = r"part-(\d{5,})(?:-u(\d{5,}))?"


def part_name(shard: int, split: int | None = None) -> str:
    """The part name of unit ``split`` of input shard ``shard``: ``part-00003-u00002.parquet``
    (also its only data file's name when its rows fit in one file); ``split=None``: the
    whole-shard part of the layout before units, ``part-00003.parquet``."""
    return f"part-{shard:05d}.parquet" if split is None else f"part-{shard:05d}-u{split:05d}.parquet"


def parse_part(part: str) -> tuple[int, int | None] | None:
    """``part-00003-u00002.parquet`` -> ``(3, 2)``; ``part-00003.parquet`` -> ``(3, None)``;
    anything else -> None."""
    m = re.fullmatch(PART_PATTERN + r"\.parquet", part, re.ASCII)
    if not m:
        return None
    return int(m.group(1)), None if m.group(2) is None else int(m.group(2))


@dataclass(frozen=True)
class Shard:
    """One input file.  ``url`` carries the protocol (``s3://b/k.parquet``, ``/abs/x.jsonl``)
    and is the file's resolved location (a local file's real path; ``//``, ``./`` and
    ``x/..`` collapsed elsewhere), so every spelling of one file is the same shard."""

    index: int
    url: str
    format: str  # "parquet" | "jsonl"
    num_rows: int
    #: what identifies this version of the file: ``size=...;etag=...`` (S3) or
    #: ``size=...;mtime=...`` (local); compared on resume (see pipeline.output)
    fingerprint: str | None = None
    #: the file's path relative to the input location (``a/b.jsonl``); derived ids use it
    name: str | None = None
    #: the fsspec compression the file is read with (``gzip``, ``bz2``, ``zstd``, ``xz``) or None
    compression: str | None = None
    #: Hive partition values from the folders of ``name`` (``lang=de/x.parquet`` -> ``{"lang": "de"}``)
    partitions: dict[str, str | None] | None = None
    #: the file's splits, in row order (:class:`Split` records as dicts; see :meth:`units`)
    splits: tuple[dict[str, Any], ...] | None = None
    #: the file's columns (Parquet schema; JSONL fields over its lines), when the job keeps
    #: every input column (:func:`pipeline.input.discovery.resolve_shards`'s ``list_columns``)
    columns: tuple[str, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["splits"] = list(self.splits) if self.splits is not None else None
        return d

    def derived_id(self, row: int) -> str:
        """The id of a row that has none: ``<name>:<row>``."""
        return f"{self.name or posixpath.basename(self.url)}:{row}"

    def units(self) -> list["Unit"]:
        """The shard's work units (one per split; one unit of 0 rows for an empty file).
        A shard without splits (built by hand) is one unit of all its rows."""
        splits = self.splits or ({"start": 0, "rows": self.num_rows},)
        return [Unit(self, k, Split(**sp)) for k, sp in enumerate(splits)]


@dataclass(frozen=True)
class Split:
    """Where a unit's rows lie in its file.

    Attributes:
        start: the file row (``source_row``, 0-based over non-blank JSONL lines) of its first row.
        rows: how many rows.
        offset: JSONL: the byte offset of its first line in the (decompressed) stream;
            None: read from the start.
        line: JSONL: the number of physical lines before its first line (error messages
            name ``line <n>`` of the file).
        row_groups: Parquet: the row groups it reads (None: the whole file).
        first_line: JSONL: a hash of its first line's bytes as the preflight read them
            (:func:`pipeline.input.formats.line_hash`); the read checks it, so a file
            replaced while the job ran (same size, mtime restored) is refused, not read from
            the middle of a line.  None: not checked (a split built by hand).
    """

    start: int
    rows: int
    offset: int | None = None
    line: int = 0
    row_groups: tuple[int, ...] | list[int] | None = None
    first_line: str | None = None


@dataclass(frozen=True)
class Unit:
    """A work unit: one shard (input file) and one split of it; the unit of reading,
    committing and resuming (its part name: :attr:`part`, ``part-<shard>-u<split>.parquet``)."""

    shard: Shard
    split_index: int
    split: Split

    @property
    def part(self) -> str:
        return part_name(self.shard.index, self.split_index)

    @property
    def num_rows(self) -> int:
        return self.split.rows

    def to_dict(self) -> dict[str, Any]:
        return {"shard": {**self.shard.to_dict(), "splits": None}, "split_index": self.split_index,
                "split": asdict(self.split)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Unit":
        sp = dict(d["split"])
        if sp.get("row_groups") is not None:
            sp["row_groups"] = tuple(sp["row_groups"])
        return cls(Shard(**d["shard"]), int(d["split_index"]), Split(**sp))


def units_of(shards: list[Shard]) -> list[Unit]:
    """Every unit of ``shards``, shard by shard, in row order."""
    return [u for s in shards for u in s.units()]


