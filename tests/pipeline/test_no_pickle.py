"""Nothing the project reads is unpickled (issue 56, item 1).

A pickle runs code when it is loaded.  Each place that reads a training state or cache is
given a planted pickle whose payload would create a file; the file is refused by name and
the payload never runs.  A repository-wide scan fails on any unpickling call outside tests.
A few seconds: no Ray, no real model.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pipeline_testkit import job_module

REPO = Path(__file__).resolve().parents[2]


class _Payload:
    """Unpickled, it creates the file ``marker`` (what a planted pickle could do, and worse)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _plant(path: Path, marker: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state": _Payload(marker), "head": torch.zeros(2)}, path)
    return path


def test_the_planted_pickle_is_live(tmp_path):
    """The plant is a real threat: loading it the old way runs its payload (so the tests below can fail)."""
    marker = tmp_path / "ran"
    _plant(tmp_path / "p.pt", marker)
    torch.load(tmp_path / "p.pt", weights_only=False)
    assert marker.exists()


def test_state_files_round_trip_an_optimizer_and_refuse_a_pickle(tmp_path):
    from train.state_files import StateFileError, load_state, save_state

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = {"head": model.state_dict(), "opt": opt.state_dict(), "stats": {"step": 3, "losses": [1.5, float("nan")]},
             "by_k": {1: {"rate": 0.5}, 2: None}, "name": "x", "bf16": torch.ones(2, dtype=torch.bfloat16)}
    save_state(tmp_path / "s.safetensors", state)
    back = load_state(tmp_path / "s.safetensors")
    assert back["by_k"] == {1: {"rate": 0.5}, 2: None} and back["stats"]["step"] == 3
    assert back["bf16"].dtype == torch.bfloat16
    assert all(torch.equal(model.state_dict()[k], back["head"][k]) for k in back["head"])
    opt2 = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters(), lr=0.1)
    opt2.load_state_dict(back["opt"])  # int keys of the optimizer's state kept: the moments are restored
    assert set(opt2.state_dict()["state"]) == {0, 1}
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    marker = tmp_path / "ran"
    for name in ("p.safetensors", "p.pt"):
        _plant(tmp_path / name, marker)
        with pytest.raises(StateFileError, match=re.escape(str(tmp_path / name))):
            load_state(tmp_path / name)
    (tmp_path / "cut.safetensors").write_bytes((tmp_path / "s.safetensors").read_bytes()[:100])
    with pytest.raises(StateFileError, match="cut.safetensors"):
        load_state(tmp_path / "cut.safetensors")
    assert not marker.exists()


def _train_drafter_job():
    return job_module("train_drafter")


@pytest.mark.parametrize("name", ["train_state.pt", "train_state.safetensors"])
def test_train_drafter_refuses_a_planted_state_before_work_starts(tmp_path, capsys, name):
    """``jobs/train_drafter.py --output`` holding a pickle, under the old name or the new one:
    exit 2 naming it, before the job output is even read; the payload never runs."""
    marker = tmp_path / "ran"
    out = tmp_path / "head"
    _plant(out / name, marker)
    job = _train_drafter_job()
    code = job.main(["--from", str(tmp_path / "no-such-output"), "--output", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error:") and name in err and "\n" not in err, err
    assert "no-such-output" not in err  # refused before the job output was read
    assert not marker.exists()


def test_the_draft_head_script_refuses_planted_shards_and_states(tmp_path):
    """``train/train_smollm2_draft_head.py``'s caches (shards) and training state."""
    spec = importlib.util.spec_from_file_location("draft_head_script", REPO / "train" / "train_smollm2_draft_head.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    from train.state_files import StateFileError

    marker = tmp_path / "ran"
    sh = script.Shards(tmp_path / "fresh")
    sh.write([{"ids": torch.arange(4, dtype=torch.int32), "prompt_len": 2, "feats": torch.zeros(4, 1, 2)}],
             {"count": 1})
    assert sh.load()[0]["prompt_len"] == 2 and sh.meta() == [{"count": 1}]
    _plant(tmp_path / "old" / "shard-00000.pt", marker)
    with pytest.raises(StateFileError, match="shard-00000.pt"):
        script.Shards(tmp_path / "old")
    _plant(tmp_path / "new" / "shard-00000.safetensors", marker)
    with pytest.raises(StateFileError, match="shard-00000.safetensors"):
        script.Shards(tmp_path / "new").load()
    for name in ("train-state.pt", "train-state.safetensors"):
        work = tmp_path / f"work-{name}"
        _plant(work / name, marker)
        with pytest.raises(StateFileError, match=re.escape(name)):
            script.train_head(torch.nn.Linear(2, 2), None, SimpleNamespace(lr=1e-3), work, None)
    assert not marker.exists()


def test_a_pickle_planted_as_a_draft_heads_weights_does_not_run(tmp_path):
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.engine.draft_head import DraftHeadConfig, is_draft_head, load_draft_head

    target = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=2, vocab_size=64))
    marker = tmp_path / "ran"
    head = tmp_path / "head"
    _plant(head / "model.safetensors", marker)
    (head / "config.json").write_text(json.dumps(DraftHeadConfig.for_target(target).to_dict()))
    assert is_draft_head(str(head))
    with pytest.raises(ValueError):
        load_draft_head(str(head), target)
    assert not marker.exists()


#: unpickling calls: any of these outside tests fails the scan
UNPICKLING = [
    (re.compile(r"weights_only\s*=\s*False"), "weights_only=False"),
    (re.compile(r"pickle\.loads?\s*\("), "pickle.load(s)"),
    (re.compile(r"allow_pickle\s*=\s*True"), "allow_pickle=True"),
    (re.compile(r"\bread_pickle\s*\("), "pandas.read_pickle"),
    (re.compile(r"\b(?:joblib|dill)\.loads?\s*\("), "joblib/dill load"),
]


def _torch_load_calls(text: str):
    """Each ``torch.load(...)`` call's argument text (to the matching parenthesis)."""
    for m in re.finditer(r"\btorch\.load\s*\(", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        yield m.start(), text[m.end():i - 1]


def unpickling_calls(text: str) -> list[tuple[int, str]]:
    """``(line, what)`` for each unpickling call in ``text`` (a module's source)."""
    found = [(text.count("\n", 0, m.start()) + 1, what) for pat, what in UNPICKLING for m in pat.finditer(text)]
    for pos, args in _torch_load_calls(text):
        if not re.search(r"weights_only\s*=\s*True", args):
            found.append((text.count("\n", 0, pos) + 1, "torch.load without weights_only=True"))
    return sorted(found)


def test_the_scan_finds_each_kind():
    bad = ("torch.load(f, weights_only=False)\ntorch.load(\n  f)\npickle.load(f)\ncloudpickle.loads(b)\n"
           "np.load(f, allow_pickle=True)\npd.read_pickle(f)\n")
    assert [line for line, _ in unpickling_calls(bad)] == [1, 1, 2, 4, 5, 6, 7]
    assert unpickling_calls("torch.load(f, map_location='cpu', weights_only=True)\n") == []


def test_no_unpickling_call_outside_tests():
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    files += subprocess.run(["git", "ls-files", "--others", "--exclude-standard", "*.py"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split()
    offenders = []
    for rel in sorted(set(files)):
        if rel.startswith("tests/") or not (REPO / rel).is_file():
            continue
        offenders += [f"{rel}:{line}: {what}" for line, what in unpickling_calls((REPO / rel).read_text())]
    assert not offenders, "unpickling outside tests (a planted file would run): " + "; ".join(offenders)
