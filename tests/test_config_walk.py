"""scripts/config_walk.py: the config walk of ``compute.draft_length`` runs, the nightly-reuse
preflight inside it (a committed night before, ``output.previous: auto``) is traced, and the walk
stays within issue 55's bound of 30 stays.  A tiny random Llama: no weights read, no Ray."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "config_walk.py"
#: issue 55's goal for the walk
MAX_STAYS = 30


def test_the_config_walk_covers_the_nightly_reuse_preflight_within_30_stays(capsys):
    spec = importlib.util.spec_from_file_location("config_walk", SCRIPT)
    walk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(walk)
    assert walk.main([]) == 0
    line, reuse_line = capsys.readouterr().out.splitlines()[-2:]
    stays, rooms, returns = (int(word) for word in line.split() if word.isdigit())
    assert line.startswith("compute.draft_length:") and 0 < stays <= MAX_STAYS and 0 < rooms <= stays
    assert returns <= stays
    numbers = [int(word) for word in reuse_line.replace("(", " ").split() if word.isdigit()]
    assert reuse_line.lstrip().startswith("of which the nightly-reuse preflight:")
    assert numbers[0] <= stays and numbers[-1] > 0, "plan_reuse was not traced: the night before was not found"
