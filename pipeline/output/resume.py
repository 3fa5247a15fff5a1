"""The resume plan: which work units an earlier run committed, and which this run does.

Resume (``overwrite: false``, the default): :func:`plan_resume` takes the output's checked
manifest and this run's units and returns a :class:`ResumePlan`: the units already
committed *from the same source under the same config fingerprint* are skipped, so
committed rows are never duplicated or rewritten.  A manifest entry that disagrees with
today's input (another file at that shard index, the file changed, units of another
size) or with today's config (another method, generation setting, prompt template,
model file...) is refused with :class:`~pipeline.output.location.OutputError`, naming
what changed and what to do.  When every unit is committed and ``_SUCCESS`` exists the
run has nothing to do.

Outputs written before work units (one part per input file, ``part-NNNNN.parquet``, its
entry ``_manifest/part-NNNNN.json``) resume too: such a *whole-shard* entry commits every
unit of its shard (the same rows, from the same file), so those rows are neither redone
nor duplicated; the shards it does not cover run as units.  A shard with both a
whole-shard entry and unit entries is refused (no run writes both).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.fingerprint import config_fingerprint, describe_changes
from pipeline.units import parse_part
from pipeline.output.location import OutputError
from pipeline.output.records import UnitRecord


@dataclass
class ResumePlan:
    """What a run does.

    Attributes:
        todo: the units to run (:class:`pipeline.units.Unit`), in input order.
        done: part names committed earlier (skipped: units, and whole-shard parts), sorted.
        entries: part name -> manifest entry of every part committed earlier (unit
            entries, and whole-shard entries of the layout before units).
        whole_shard: part names of the whole-shard entries resumed (layout before units).
        nothing_to_do: every unit committed and the output complete (``_SUCCESS``).
    """

    todo: list = field(default_factory=list)
    done: list[str] = field(default_factory=list)
    entries: dict[str, UnitRecord] = field(default_factory=dict)
    whole_shard: list[str] = field(default_factory=list)
    nothing_to_do: bool = False


def plan_resume(url: str, units: list, entries: dict[str, UnitRecord], identity: dict[str, Any] | None,
                complete: bool = False) -> ResumePlan:
    """The resume plan of a run over ``units`` on an output whose checked manifest is ``entries``.

    Args:
        url: the output folder, for messages.
        units: this run's units (:class:`pipeline.units.Unit`), in input order.
        entries: part name -> manifest entry (:meth:`OutputLocation.inspect`); empty after
            ``overwrite`` cleared the output.
        identity: :func:`pipeline.fingerprint.config_identity` of this run's config; None =
            not compared.
        complete: whether the output's ``_SUCCESS`` is there.

    Raises:
        OutputError: an entry was committed under another config, from another file or
            version of it, by units of another size, or names a shard the input no longer
            has (see the module docstring).
    """
    if not entries:
        return ResumePlan(todo=list(units))
    if identity is not None:
        expected = config_fingerprint(identity)
        for part, entry in sorted(entries.items()):
            if entry.config_fingerprint != expected:
                raise OutputError(
                    f"output {url!r}: {part} was committed under another config "
                    f"({describe_changes(entry.config_identity, identity)}); resuming would mix "
                    "outputs of two configs: rerun with --overwrite (output.overwrite: true) to redo the "
                    "output from scratch, or choose another output.uri"
                )
    shards = {u.shard.index: u.shard for u in units}
    by_part = {u.part: u for u in units}
    whole: dict[int, str] = {}
    split_parts: dict[int, list[str]] = {}
    for part, entry in sorted(entries.items()):
        shard_index, split = parse_part(part)  # checked names: always parses
        shard = shards.get(shard_index)
        if shard is None:
            raise OutputError(
                f"output {url!r}: {part} was committed from {entry.source_file!r}, but the input "
                f"has only {len(shards)} shards now; set output.overwrite: true (--overwrite) to start afresh"
            )
        if entry.source_file != shard.url or entry.fingerprint != shard.fingerprint:
            raise OutputError(
                f"output {url!r}: {part} was committed from {entry.source_file!r} "
                f"({entry.fingerprint}), but input shard {shard.index} is now {shard.url!r} "
                f"({shard.fingerprint}): the input changed since; set output.overwrite: true (--overwrite) "
                "to start afresh, or choose another output.uri"
            )
        if split is None:
            if entry.rows is not None and entry.rows != shard.num_rows:
                raise OutputError(f"output {url!r}: {part} holds {entry.rows} rows, but input shard "
                                  f"{shard.url!r} has {shard.num_rows}: set output.overwrite: true (--overwrite)")
            whole[shard_index] = part
            continue
        split_parts.setdefault(shard_index, []).append(part)
        unit = by_part.get(part)
        if (unit is None or entry.start_row != unit.split.start or entry.rows != unit.num_rows):
            was = entry.split_rows
            back = f"set input.split_rows: {was} to resume, or " if was is not None else ""
            raise OutputError(
                f"output {url!r}: {part} holds {entry.rows} rows of {shard.url!r} from row "
                f"{entry.start_row}, committed in units of {was if was is not None else 'another size'} "
                f"(input.split_rows), but this run's unit {part} of that file differs; {back}set "
                "output.overwrite: true (--overwrite) to start afresh")
    both = sorted(set(whole) & set(split_parts))
    if both:
        raise OutputError(f"output {url!r}: input shard {both[0]} is committed both whole ({whole[both[0]]}) and "
                          f"by units ({split_parts[both[0]][0]}...): set output.overwrite: true (--overwrite)")
    todo = [u for u in units if u.shard.index not in whole and u.part not in entries]
    done = sorted(entries)
    return ResumePlan(todo=todo, done=done, entries=dict(entries), whole_shard=sorted(whole.values()),
                      nothing_to_do=not todo and complete)
