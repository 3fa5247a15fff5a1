"""The server tests import serve_testkit.py (this folder) and the engine tests' tiny_models.py."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "engine"))
