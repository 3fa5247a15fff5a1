"""Kept importable until the other branches of this round are merged: the input side is
now the package :mod:`pipeline.input` (discovery, formats, rows, units).  Import from
there; this module goes once nothing imports it."""

from pipeline.input import (UNIT_COLUMN, InputError, Shard, Split, Unit, check_partition_keys, file_kind,  # noqa: F401
                            hive_partitions, partition_keys, read_shard, read_unit, read_units_batch,
                            resolve_shards, units_of)
from pipeline.schema import INPUT_SCHEMA  # noqa: F401
from pipeline.storage import file_version as shard_fingerprint  # noqa: F401 (its old name)
