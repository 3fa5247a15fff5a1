"""Ray job entry point: the generate job: prompts from any input columns or chat messages, per-row parameters, structured (JSON-schema) output.

Locally (embedded Ray)::

    python jobs/generate.py --config configs/generate.yaml

On a cluster::

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- python jobs/generate.py --config configs/generate.yaml

Options: ``python jobs/generate.py --help`` (see pipeline/cli.py).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: pipeline/, actors/

from pipeline.imports import require_packages  # noqa: E402

require_packages("jobs/generate.py")  # one line, exit 2, under a Python that lacks torch & co.

from pipeline.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main("generate"))
