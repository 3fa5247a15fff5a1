"""The input side of a job: one package, one owner for each fact (it mirrors :mod:`pipeline.output`).

- :mod:`pipeline.input.formats`: which files are read and how (Parquet, JSONL plain or compressed), streams that
  never end early in silence, :class:`InputError`;
- :mod:`pipeline.input.discovery`: in the driver, before any model loads: the listing, each shard checked, counted
  and split into units (:func:`resolve_shards`);
- :mod:`pipeline.input.rows`: on the workers: one unit's rows into ``INPUT_SCHEMA`` (:func:`read_unit`).

What it shares with :mod:`pipeline.output` lies below both, and neither package imports the other:
the work units (shards, splits, units and their part names, :data:`UNIT_COLUMN`) are
:mod:`pipeline.units`'s, re-exported here; storage helpers (local or object store, resolved locations, file
versions, files never opened, refusal or passing fault) are :mod:`pipeline.storage`'s; an output folder's
names are :mod:`pipeline.layout`'s.
"""

from __future__ import annotations

from pipeline.input.discovery import carried_columns, check_partition_keys, hive_partitions, partition_keys, resolve_shards  # noqa: F401
from pipeline.input.formats import InputError, file_kind, open_stream  # noqa: F401
from pipeline.input.rows import read_shard, read_unit, read_units_batch  # noqa: F401
from pipeline.units import UNIT_COLUMN, Shard, Split, Unit, part_name, units_of  # noqa: F401
