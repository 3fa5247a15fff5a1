"""jobs/train_drafter.py on a real job output: a tiny random target's own greedy answers,
written by run_job (a local Ray).  The draft head trains on them teacher-forced, a killed
run resumes to the very head an uninterrupted run makes, the held-back acceptance is
measured before and after (and rises: the target's answers are what the head learns), the
head is promoted only when better, and bad inputs are refused in one line with exit 2."""

import json
from pathlib import Path

import pytest
import torch

from pipeline_testkit import TEXTS, job_config, job_module, write_jsonl


def _job():
    return job_module("train_drafter")


ROWS = 32


@pytest.fixture(scope="module")
def job_output(ray_local, tmp_path_factory):
    """A finished job output: 32 rows, plain greedy decoding, 24 new tokens each, of a tiny
    random target whose output layer is scaled up, so that its next-token distributions are
    peaked (a random one's are nearly uniform: nothing a head could learn beyond the argmax)."""
    from transformers import AutoModelForCausalLM

    from pipeline.run import run_job
    from tiny import make_model_pair

    d = tmp_path_factory.mktemp("drafter")
    target, drafter = make_model_pair(d / "models", seed=3)
    model = AutoModelForCausalLM.from_pretrained(target)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    model.save_pretrained(target)
    rows = [{"id": f"r{i}", "text": f"{TEXTS[i % len(TEXTS)]} {TEXTS[(3 * i + 1) % len(TEXTS)]}"} for i in range(ROWS)]
    write_jsonl(d / "in" / "rows.jsonl", rows)
    cfg = job_config({"target": target, "drafter": drafter}, str(d / "in"), str(d / "out"), method="plain",
                     overrides=["generation.max_new_tokens=24", "audit.fraction=0"])
    run_job(cfg, progress=False)
    return d / "out"


def _args(out, head_dir, *extra):
    return ["--from", str(out), "--output", str(head_dir), "--holdout", "0.25", "--tokens-per-step", "128", *extra]


def _head_tensors(path):
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "model.safetensors"))


@pytest.mark.slow
def test_trains_on_the_jobs_answers_and_acceptance_rises(job_output, tmp_path, capsys):
    job = _job()
    assert job.main(_args(job_output, tmp_path / "h", "--steps", "30", "--lr", "3e-3")) == 0
    printed = capsys.readouterr().out
    assert "before" in printed and "after" in printed and "better: trained" in printed
    report = json.loads((tmp_path / "h" / "report.json").read_text())
    rows = report["rows"]
    assert rows["committed"] == ROWS and rows["left_out"] == {} and rows["used"] == ROWS
    assert rows["trained_on"] + rows["held_back"] == ROWS and rows["held_back"] >= 3
    # the prompt ids were rebuilt exactly (no row left out: each has its prompt_tokens), the answers are the
    # target's own ids (output_token_ids: no special token lost by output_text), so after them the target's
    # greedy choice is the answer token
    assert rows["answers_from_token_ids"] == rows["answers_retokenized_exactly"] == ROWS
    assert rows["held_back_answer_tokens_equal_to_the_targets_argmax"] > 0.99
    before, after = report["acceptance"]["before"]["by_k"], report["acceptance"]["after"]["by_k"]
    assert set(before) == set(after) == {"1", "2", "3", "4"}
    assert after["1"]["acceptance_rate"] > before["1"]["acceptance_rate"] + 0.2
    assert after["4"]["mean_accepted_length"] > before["4"]["mean_accepted_length"]
    assert report["better"] == "trained" and report["training"]["steps"] == 30
    # the saved head loads for method eagle and drafts losslessly
    from pipeline.engine import GenerationSettings, SpeculationSettings, SpeculativeEngine
    from pipeline.engine.draft_head import load_draft_head
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(report["target"], dtype=torch.float32).eval()
    head = load_draft_head(tmp_path / "h", target)
    assert head.head_config.training["script"] == "jobs/train_drafter.py"
    prompt = torch.tensor([[1, 5, 9, 7, 12, 30]])
    plain = SpeculativeEngine(target).generate(prompt, GenerationSettings(max_new_tokens=16)).token_ids
    eagle = SpeculativeEngine(target, SpeculationSettings(method="eagle", num_assistant_tokens=3), drafter=head)
    assert eagle.generate(prompt, GenerationSettings(max_new_tokens=16)).token_ids == plain


@pytest.mark.slow
def test_a_killed_run_resumes_to_the_uninterrupted_runs_head(job_output, tmp_path, monkeypatch):
    job = _job()
    assert job.main(_args(job_output, tmp_path / "straight", "--steps", "7")) == 0
    import train.drafter_from_outputs as drafter

    monkeypatch.setattr(drafter, "SAVE_EVERY", 2)
    calls = []

    import train.draft_head_training as training

    original = training.train_step

    def dies_at_the_sixth(*a, **kw):
        calls.append(1)
        if len(calls) == 6:
            raise KeyboardInterrupt
        return original(*a, **kw)

    monkeypatch.setattr(training, "train_step", dies_at_the_sixth)
    with pytest.raises(KeyboardInterrupt):
        job.main(_args(job_output, tmp_path / "killed", "--steps", "7"))
    from train.state_files import load_state

    state = load_state(tmp_path / "killed" / "train_state.safetensors")
    assert state["state"]["step"] == 4  # the last checkpoint before the kill
    assert not (tmp_path / "killed" / "model.safetensors").exists()  # no half-written head
    monkeypatch.setattr(training, "train_step", original)
    assert job.main(_args(job_output, tmp_path / "killed", "--steps", "7")) == 0
    a, b = _head_tensors(tmp_path / "straight"), _head_tensors(tmp_path / "killed")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    ra = json.loads((tmp_path / "straight" / "report.json").read_text())
    rb = json.loads((tmp_path / "killed" / "report.json").read_text())
    assert ra["acceptance"] == rb["acceptance"] and rb["training"]["steps"] == 7
    # a rerun with more steps continues from the finished run's state
    assert job.main(_args(job_output, tmp_path / "killed", "--steps", "9")) == 0
    assert json.loads((tmp_path / "killed" / "report.json").read_text())["training"]["steps"] == 9


@pytest.mark.slow
def test_promoted_only_when_better(job_output, tmp_path):
    job = _job()
    promoted = tmp_path / "current"
    assert job.main(_args(job_output, tmp_path / "night1", "--steps", "20", "--lr", "3e-3",
                          "--promote-to", str(promoted))) == 0
    report = json.loads((tmp_path / "night1" / "report.json").read_text())
    assert report["promoted_to"] == str(promoted) and report["better"] == "trained"
    stamp = (promoted / "model.safetensors").stat().st_mtime_ns
    # next night: the current head trained 0 steps more is no better than itself -> not promoted
    assert job.main(_args(job_output, tmp_path / "night2", "--steps", "0", "--head", str(promoted),
                          "--promote-to", str(promoted))) == 0
    again = json.loads((tmp_path / "night2" / "report.json").read_text())
    assert again["better"] == "current" and again["promoted_to"] is None
    assert again["compared"]["trained"] == again["compared"]["current"]
    assert (promoted / "model.safetensors").stat().st_mtime_ns == stamp


@pytest.mark.slow
def test_bad_inputs_are_refused_in_one_line(job_output, tmp_path, capsys):
    job = _job()
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    (tmp_path / "empty").mkdir()
    cases = [
        (["--from", str(tmp_path / "missing"), "--output", str(tmp_path / "o")], "missing' does not exist"),
        (["--from", str(tmp_path / "empty"), "--output", str(tmp_path / "o")], "empty' is an empty folder"),
        (["--from", str(tmp_path / "foreign"), "--output", str(tmp_path / "o")], "no committed unit"),
        (["--from", str(job_output)], "--output is required"),
        (_args(job_output, tmp_path / "o", "--max-rows", "0"), "no usable rows"),
        (_args(job_output, tmp_path / "o", "--target", str(tmp_path / "nope")), "--target"),
        (_args(job_output, tmp_path / "o", "--head", str(job_output)), "is not a draft-head folder"),
        (_args(job_output, tmp_path / "foreign"), "holds files this job did not write"),
        (_args(job_output, tmp_path / "o", "--holdout", "0"), "--holdout must be between 0 and 1"),
    ]
    for args, message in cases:
        capsys.readouterr()
        assert job.main(args) == 2, args
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and message in err and "\n" not in err, (args, err)
    assert (tmp_path / "foreign" / "notes.txt").read_text() == "mine" and not (tmp_path / "o").exists()


def test_answers_are_the_stored_token_ids_else_the_text_re_tokenized():
    """``output_token_ids`` is the target's answer exactly (a special token the text skips kept);
    an output written before that column existed has its text re-tokenized, with the EOS."""
    from pipeline.config import TaskConfig
    from pipeline.prompts import PromptBuilder
    from tiny import make_tokenizer
    from train.drafter_from_outputs import JobOutput, rows_to_ids

    tok, task = make_tokenizer(), TaskConfig(chat_template=False)
    prompt, ids = PromptBuilder(tok, task).build(TEXTS[0])
    answer = tok("the cat sat", add_special_tokens=False)["input_ids"]
    pad, eos = tok.pad_token_id, tok.eos_token_id
    base = {"prompt": prompt, "error": None, "prompt_tokens": len(ids), "finish_reason": "stop"}
    rows = [dict(base, id="stored", output_text="the cat sat", new_tokens=5, output_token_ids=[*answer, pad, eos]),
            dict(base, id="older", output_text="the cat sat", new_tokens=4, output_token_ids=None)]
    job = JobOutput("out", rows, {}, {}, {}, [], {})
    got, skipped = rows_to_ids(job, tok, task, [eos], [])
    assert skipped == {} and [r.ids[r.prompt_len:] for r in got] == [[*answer, pad, eos], [*answer, eos]]
    assert [(r.exact_answer, r.from_ids) for r in got] == [(True, True), (True, False)]
