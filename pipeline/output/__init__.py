"""The output side of a job: one package, one owner for each fact.

- :mod:`pipeline.output.layout`: the names of an output folder, and which files are the job's;
- :mod:`pipeline.output.location`: one output folder: listing, the checked manifest, foreign files, overwrite;
- :mod:`pipeline.output.resume`: the resume plan (:func:`plan_resume`), a function of the manifest and the units;
- :mod:`pipeline.output.sink`: the write stage on the workers (a unit's rows -> staged Parquet fragments);
- :mod:`pipeline.output.writer`: the unit commit in the driver (intent, publish, manifest entry) and the final commit;
- :mod:`pipeline.output.lease`: one run at a time per output folder, by storage backend;
- :mod:`pipeline.output.reader`: the one reader of committed output (:class:`~pipeline.output.reader.CommittedOutput`).

The part names are the input units' (:mod:`pipeline.input.units`); storage helpers both
sides use are :mod:`pipeline.storage`'s.
"""

from __future__ import annotations

import posixpath

from pipeline.input.units import part_name  # noqa: F401 (the units own the part names)
from pipeline.output.layout import SUCCESS, data_file_names  # noqa: F401
from pipeline.output.location import OutputError, OutputLocation  # noqa: F401
from pipeline.output.resume import ResumePlan, plan_resume  # noqa: F401
from pipeline.output.writer import OutputWriter, RunError  # noqa: F401


def is_complete(uri: str, storage_options: dict | None = None) -> bool:
    """Whether ``uri`` holds a finished run (its ``_SUCCESS`` marker exists)."""
    from pipeline.retry import open_fs

    fs, root = open_fs(uri, storage_options)
    return fs.exists(posixpath.join(root.rstrip("/"), SUCCESS))
