"""Ray job entry point: the summarize job.

Locally (embedded Ray)::

    python jobs/summarize.py --config configs/summarize.yaml

On a cluster::

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- python jobs/summarize.py --config configs/summarize.yaml

Options: ``python jobs/summarize.py --help`` (see pipeline/cli.py).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: pipeline/, actors/

from pipeline.imports import require_packages  # noqa: E402

require_packages("jobs/summarize.py")  # one line, exit 2, under a Python that lacks torch & co.

from pipeline.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main("summarize"))
