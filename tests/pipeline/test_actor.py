"""GenerateActor in-process: prompts, per-row errors, statistics equal to the engine's."""

import pyarrow as pa
import pytest

from actors.generate import GenerateActor
from pipeline_testkit import TEXTS, job_config
from pipeline.engine import SpeculativeEngine
from pipeline.prompts import PromptBuilder, PromptError, fill_template
from pipeline.schema import INPUT_SCHEMA
from pipeline.schema import OUTPUT_SCHEMA
from tiny import make_tokenizer


def _rows(texts, errors=None):
    errors = errors or [None] * len(texts)
    return pa.Table.from_pylist(
        [{"source_file": "f", "source_row": i, "id": f"r{i}", "text": t, "input_error": e}
         for i, (t, e) in enumerate(zip(texts, errors))],
        schema=INPUT_SCHEMA,
    )


@pytest.fixture(scope="module")
def actor(tiny_models, tmp_path_factory):
    # a fixed draft length, so that a batched row's statistics equal its single-row ones
    cfg = job_config(tiny_models, "unused", str(tmp_path_factory.mktemp("o")),
                     overrides=["compute.draft_length=fixed"])
    return GenerateActor(cfg.model_dump(), device="cpu")


def test_bad_rows_get_an_error_and_the_batch_goes_on(actor):
    too_long = " ".join(["the cat sat on the mat"] * 60)  # > 256 tokens of context
    batch = _rows([TEXTS[0], None, "   ", None, too_long, TEXTS[1]],
                  errors=[None, None, None, "prompt is a int, not a string", None, None])
    out = actor(batch)
    assert out.schema == OUTPUT_SCHEMA and out.num_rows == 6
    rows = out.to_pylist()
    errors = [r["error"] for r in rows]
    assert errors[0] is None and errors[5] is None
    assert "prompt is null" in errors[1]
    assert "prompt is empty" in errors[2]
    assert "not a string" in errors[3]
    assert errors[4].startswith("ValueError") and "context" in errors[4].lower()
    for r in (rows[1], rows[4]):
        assert r["new_tokens"] is None and r["output_text"] is None
    assert rows[4]["prompt"]  # the prompt was built; the engine refused it
    for r in (rows[0], rows[5]):
        assert r["new_tokens"] > 0 and r["finish_reason"] in ("stop", "length")
        assert r["method"] == "draft_model" and r["draft_model"] and r["target_model"]


def test_row_statistics_equal_the_engine(actor, tiny_models):
    out = actor(_rows(TEXTS[:3])).to_pylist()
    m = actor.models
    engine = SpeculativeEngine(m.target, actor.cfg.method.speculation_settings(), drafter=m.drafter, tokenizer=m.tokenizer,
                               draft_length=actor.cfg.compute.draft_length)  # the actor's (fixed k)
    builder = PromptBuilder(m.tokenizer, actor.cfg.task)
    for text, row in zip(TEXTS[:3], out):
        prompt, ids = builder.build(text)
        res = engine.generate(ids, actor.cfg.generation.generation_settings())
        st = res.stats.to_dict()
        assert row["prompt"] == prompt
        for k in ("prompt_tokens", "new_tokens", "verify_steps", "draft_tokens", "accepted_tokens",
                  "acceptance_rate", "mean_accepted_length", "drafted_per_position", "accepted_per_position",
                  "draft_steps", "tokens_per_step"):
            assert row[k] == st[k], k
        assert row["finish_reason"] == res.finish_reason
        assert row["output_text"] == m.tokenizer.decode(res.token_ids, skip_special_tokens=True)
        assert row["wall_time_s"] > 0 and row["draft_time_s"] >= 0


def test_memory_report(actor):
    mem = actor.memory()
    assert mem["peak_rss_mb"] > 0 and mem["device"] == "cpu" and mem["rows"] >= 1


def test_prompt_templates_and_chat_template():
    from pipeline.config import TaskConfig

    task = TaskConfig(name="translate", source_lang="English", target_lang="French")
    assert fill_template("hi", task).startswith("Translate the following text from English to French")
    with pytest.raises(PromptError):
        fill_template(3, task)
    plain = PromptBuilder(make_tokenizer(), TaskConfig())
    assert not plain.use_chat
    prompt, ids = plain.build("the cat")
    assert ids[0] == 1 and prompt.startswith("Summarize")  # BOS added
    chat_tok = make_tokenizer(chat_template="{% for m in messages %}<s> {{ m['content'] }} {% endfor %}article")
    chat = PromptBuilder(chat_tok, TaskConfig(system_prompt="summary"))
    assert chat.use_chat
    prompt, ids = chat.build("the cat")
    assert prompt.startswith("<s> summary <s> Summarize") and prompt.endswith("article")
    assert ids.count(1) == 2  # BOS from the template only
    assert not PromptBuilder(chat_tok, TaskConfig(chat_template=False)).use_chat
    with pytest.raises(ValueError, match="chat template"):
        PromptBuilder(make_tokenizer(), TaskConfig(chat_template=True))
