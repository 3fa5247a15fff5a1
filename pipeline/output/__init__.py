"""The output side of a job: one package, one owner for each fact.

- :mod:`pipeline.output.records`: the commit protocol's records, typed (each its own encoding and decoding);
- :mod:`pipeline.output.exclusive`: create-exclusive writes (``link()`` locally, ``If-None-Match: *`` on S3);
- :mod:`pipeline.output.commit_log`: the commit log, where every commit is a record the storage creates once;
- :mod:`pipeline.output.manifest`: the manifest read back and checked (the log, and earlier versions' records);
- :mod:`pipeline.output.location`: one output folder: listing, foreign files, orphans, quarantine, overwrite;
- :mod:`pipeline.output.resume`: the resume plan (:func:`plan_resume`), a function of the manifest and the units;
- :mod:`pipeline.output.sink`: the write stage on the workers (a unit's rows -> staged Parquet fragments),
  :meth:`OutputWriter.write <pipeline.output.writer.OutputWriter.write>`;
- :mod:`pipeline.output.lease_backends`, :mod:`pipeline.output.lease`: one run at a time per output folder;
- :mod:`pipeline.output.writer`: :class:`~pipeline.output.writer.OutputWriter`, the commit protocol's phases
  under Ray Data ``Datasink``'s hook names: ``on_write_start`` (the run's begin, its epoch), ``write`` (on the
  workers), ``add_fragments`` (the unit commit in the driver: publish, then the unit's record),
  ``on_write_complete`` (the final commit), ``on_write_failed``;
- :mod:`pipeline.output.reader`: the one reader of committed output (:class:`~pipeline.output.reader.CommittedOutput`).

Below it, shared with :mod:`pipeline.input` (neither package imports the other): the names of an output folder
(:mod:`pipeline.layout`), the work units and their part names (:mod:`pipeline.units`), the storage helpers
(:mod:`pipeline.storage`).  :func:`listing_view` is what the input listing asks of the job's output.
"""

from __future__ import annotations

from pipeline.units import part_name  # noqa: F401 (the units own the part names)
from pipeline.layout import SUCCESS, data_file_names  # noqa: F401
from pipeline.output.location import OutputError, OutputLocation, listing_view  # noqa: F401
from pipeline.output.resume import ResumePlan, plan_resume  # noqa: F401
from pipeline.output.writer import OutputWriter, RunError  # noqa: F401


def is_complete(uri: str, storage_options: dict | None = None) -> bool:
    """Whether ``uri`` holds a finished run: its ``_SUCCESS`` marker exists and names the run
    whose ``final`` record ends the commit log (:meth:`OutputLocation.complete`).

    Raises:
        OutputError: a record of its manifest is not this job's.
    """
    from pipeline.config import OutputConfig

    cfg = OutputConfig(uri=uri, partition_by_date=False, storage_options=storage_options or {})
    return OutputLocation(cfg).complete()
