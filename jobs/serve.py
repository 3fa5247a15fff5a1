"""Entry point of the online server: the job config's model pair and method behind an
OpenAI-style API on Ray Serve (see pipeline/serve/).

    python jobs/serve.py --config configs/summarize.yaml [--host 127.0.0.1] [--port 8000]

or, with Ray Serve's own command (port 8000; a Serve config file sets another)::

    serve run pipeline.serve:app_builder config=configs/summarize.yaml [section.key=value ...]

Options: ``python jobs/serve.py --help``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: pipeline/, actors/

from pipeline.imports import require_packages  # noqa: E402

require_packages("jobs/serve.py")  # one line, exit 2, under a Python that lacks torch & co.

from pipeline.serve import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
