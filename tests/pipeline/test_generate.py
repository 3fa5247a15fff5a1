"""The generate job (issue 53): templates over any columns, chat messages, per-row parameters,
the structured-output columns, the reuse key, and the job end to end on the tiny pair."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actors.generate import GenerateActor
from pipeline.config import ConfigError, TaskConfig, load_config
from pipeline.input import InputError, resolve_shards
from pipeline.config import InputConfig
from pipeline.params import ParamsError, RowParams, apply_params, parse_params
from pipeline.prompts import PromptError, fill, parse_messages
from pipeline.reuse import row_reuse_key
from pipeline.schema import CARRIED_COLUMN, INPUT_SCHEMA, OUTPUT_SCHEMA
from pipeline.structured import structured_columns
from pipeline_testkit import REPO, TEXTS, job_config, write_jsonl

TEMPLATE = "Item: {name}\nBrand: {brand}\nPrice: {price}\nAbout: {text}\n"
CHAT = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")


def _batch(values: list[dict], carry=("name", "brand", "price", "text", "params", "messages")) -> pa.Table:
    schema = INPUT_SCHEMA.append(pa.field(CARRIED_COLUMN, pa.string()))
    return pa.Table.from_pylist(
        [{"source_file": "f", "source_row": i, "id": f"r{i}", "text": None, "input_error": None,
          CARRIED_COLUMN: json.dumps({k: v for k, v in vals.items() if k in carry})} for i, vals in enumerate(values)],
        schema=schema)


@pytest.fixture(scope="module")
def make_actor(tiny_models, tmp_path_factory):
    made = {}

    def make(*sets: str) -> GenerateActor:
        if sets not in made:
            cfg = job_config(tiny_models, "unused", str(tmp_path_factory.mktemp("o")), method="plain",
                             overrides=["task.name=generate", f"task.prompt_template={json.dumps(TEMPLATE)}",
                                        "task.chat_template=false", "input.params_column=params", *sets])
            a = GenerateActor(cfg.model_dump(), device="cpu",
                              carry=["name", "brand", "price", "text", "params", "messages"])
            a.models.tokenizer.chat_template = CHAT
            made[sets] = a
        return made[sets]

    return make


# ----------------------------------------------------------------------------- templates
def test_a_template_fills_several_columns_as_text_and_braces_in_values_stay_literal(make_actor):
    actor = make_actor()
    rows = [{"name": "Lamp {brand} {0} {name!r}", "brand": "Lumo", "price": 4.5, "text": TEXTS[0]},
            {"name": "Shoe", "brand": "Np", "price": 10, "text": "{__class__}"}]
    out = actor(_batch(rows)).to_pylist()
    assert out[0]["prompt"] == f"Item: Lamp {{brand}} {{0}} {{name!r}}\nBrand: Lumo\nPrice: 4.5\nAbout: {TEXTS[0]}\n"
    assert out[1]["prompt"] == "Item: Shoe\nBrand: Np\nPrice: 10\nAbout: {__class__}\n"
    assert all(r["error"] is None and r["new_tokens"] > 0 for r in out)
    # every carried input column is kept on output, as text (a number as its JSON)
    assert [(r["name"], r["brand"], r["price"]) for r in out] == [("Lamp {brand} {0} {name!r}", "Lumo", "4.5"),
                                                                   ("Shoe", "Np", "10")]


def test_a_null_in_a_named_column_is_a_row_error_and_the_batch_goes_on(make_actor):
    out = make_actor()(_batch([{"name": "A", "brand": None, "price": 1, "text": "x"},
                               {"name": "B", "price": 1, "text": "x"},
                               {"name": "C", "brand": "c", "price": 1, "text": "x"}])).to_pylist()
    assert "column 'brand' is null" in out[0]["error"] and "column 'brand' is null" in out[1]["error"]
    assert out[0]["new_tokens"] is None and out[2]["error"] is None and out[2]["new_tokens"] > 0


def test_fill_and_template_checks():
    assert fill("{a}-{b}{{c}}", {"a": "{b}", "b": "x"}) == "{b}-x{c}"
    for bad, word in (("{a.b}", "placeholder"), ("{a[0]}", "placeholder"), ("{a!r}", "placeholder"),
                      ("{a:>5}", "placeholder"), ("{}", "empty"), ("{a", "malformed"), ("plain", "no input column")):
        with pytest.raises(ValueError, match=word):
            TaskConfig(name="generate", prompt_template=bad)
    assert TaskConfig(name="translate", source_lang="de", target_lang="en").columns == ["text"]


# ----------------------------------------------------------------------------- messages
def test_messages_column_renders_with_the_chat_template_and_malformed_rows_are_named(make_actor):
    actor = make_actor("input.messages_column=messages")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi {name}"}]
    rows = [{"messages": msgs}, {"messages": json.dumps(msgs)},
            {"messages": [{"role": "customer", "content": "x"}]}, {"messages": [{"role": "user", "content": 3}]},
            {"messages": []}, {"messages": "[not json"}, {}]
    out = actor(_batch(rows)).to_pylist()
    want = "<system>Be brief.\n<user>Hi {name}\n<assistant>"
    assert out[0]["prompt"] == want and out[1]["prompt"] == want
    assert out[0]["output_token_ids"] == out[1]["output_token_ids"] and out[0]["error"] is None
    errors = [r["error"] for r in out[2:]]
    assert all("row 'r" in e and "input.messages_column" in e for e in errors), errors
    assert "messages[0].role" in errors[0] and "customer" in errors[0]
    assert "messages[0].content" in errors[1]
    assert "non-empty list" in errors[2] and "not JSON" in errors[3] and "null" in errors[4]


def test_parse_messages_joins_text_parts():
    got = parse_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert got == [{"role": "user", "content": "ab"}]
    with pytest.raises(PromptError, match=r"messages\[0\]"):
        parse_messages([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])


# ----------------------------------------------------------------------------- per-row parameters
def test_per_row_params_override_the_job_and_bad_values_name_the_field(make_actor):
    actor = make_actor()
    base = {"name": "A", "brand": "b", "price": 1, "text": TEXTS[1]}
    rows = [dict(base), dict(base, params={"max_tokens": 3}), dict(base, params={"max_tokens": 500}),
            dict(base, params=json.dumps({"stop": ["the"], "max_tokens": 5})),
            dict(base, params={"temperature": 0.8, "top_k": 5, "top_p": 0.9, "seed": 3}),
            dict(base, params={"temprature": 0.5}), dict(base, params={"top_p": 1.5}),
            dict(base, params={"max_tokens": "5"}), dict(base, params={"stop": [""]}), dict(base, params=[1])]
    out = actor(_batch(rows)).to_pylist()
    job = actor.settings.max_new_tokens
    assert out[0]["max_tokens_used"] is None and out[0]["new_tokens"] == job  # the tiny model never stops early
    assert out[1]["max_tokens_used"] == 3 and out[1]["new_tokens"] == 3
    assert out[1]["output_token_ids"] == out[0]["output_token_ids"][:3]  # greedy: a prefix of the job's row
    assert out[2]["max_tokens_used"] == job and out[2]["new_tokens"] == job  # held to generation.max_new_tokens
    assert out[2]["output_token_ids"] == out[0]["output_token_ids"]
    assert out[3]["new_tokens"] <= 5 and out[4]["error"] is None
    # the sampled row draws from its own generator: the same params give the same tokens again
    again = actor(_batch([rows[4]])).to_pylist()[0]
    assert again["output_token_ids"] == out[4]["output_token_ids"]
    errors = [r["error"] for r in out[5:]]
    assert "params.temprature" in errors[0] and "unknown parameter" in errors[0]
    assert "params.top_p" in errors[1] and "params.max_tokens" in errors[2]
    assert "params.stop" in errors[3] and "must be an object" in errors[4]
    assert all(r["new_tokens"] is None for r in out[5:])


def test_the_audit_compares_greedy_rows_only(make_actor):
    """A row that samples (its own temperature) is a draw of the target's law, not the draw plain
    decoding makes from the same seed: the audit leaves it out (null), and audits the greedy rows."""
    actor = make_actor("audit.fraction=1.0")
    base = {"name": "A", "brand": "b", "price": 1, "text": TEXTS[1]}
    rows = [dict(base), dict(base, params={"temperature": 0.8, "seed": 3}), dict(base, params={"max_tokens": 3})]
    out = actor(_batch(rows)).to_pylist()
    assert [r["error"] for r in out] == [None, None, None]
    assert [r["audit"] for r in out] == [True, None, True]


def test_apply_params_maps_openai_names_to_the_engine_settings():
    from pipeline.engine import GenerationSettings

    job = GenerationSettings(max_new_tokens=20, do_sample=False, temperature=1.0)
    s, used = apply_params(parse_params({"temperature": 0.5, "top_k": -1, "max_tokens": 50, "stop": "x"}), job, 20)
    assert (s.do_sample, s.temperature, s.top_k, s.max_new_tokens, s.stop_strings, used) == (
        True, 0.5, 0, 20, ["x"], 20)
    s, used = apply_params(parse_params({"temperature": 0}), GenerationSettings(do_sample=True, temperature=0.7), 20)
    assert s.do_sample is False and used is None
    assert parse_params(None) == RowParams() and parse_params("null") == RowParams()
    with pytest.raises(ParamsError, match="params.seed"):
        parse_params({"seed": 1.5})


# ----------------------------------------------------------------------------- structured columns
def test_structured_columns_validate_against_the_schema_and_mark_cut_rows():
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}},
                                         "kind": {"enum": ["a", "b"]}}, "required": ["kind"]}}}
    assert structured_columns('{"kind": "a", "tags": ["x"]}', "stop", rf) == {
        "output_json": '{"kind":"a","tags":["x"]}', "output_valid": True}
    assert structured_columns('{"kind": "c"}', "stop", rf) == {"output_json": None, "output_valid": False}
    assert structured_columns('{"kind": "a"', "length", rf, grammar_complete=False)["output_valid"] is False
    # cut by its budget before the grammar completed: never valid, even when the text parses
    assert structured_columns('{"kind": "a"}', "length", rf)["output_valid"] is False
    assert structured_columns("b", "stop", {"type": "choice", "choice": ["a", "b"]}) == {
        "output_json": '"b"', "output_valid": True}
    assert structured_columns("x", "stop", None) == {"output_json": None, "output_valid": None}


# ----------------------------------------------------------------------------- reuse keys
def test_the_reuse_key_covers_template_messages_params(make_actor):
    a = make_actor()
    b = make_actor("task.prompt_template='Other: {name} {brand} {price} {text}'")
    m = make_actor("input.messages_column=messages")
    row = {"source_file": "f", "source_row": 0, "id": "r0"}
    base = {"name": "A", "brand": "b", "price": 1, "text": TEXTS[2]}

    def key(actor, values):
        _, ids = actor._prompt(row, values)
        return row_reuse_key("fp", ids, actor._row_settings(row, ids, values, {}), actor.settings)

    k = key(a, base)
    assert key(a, dict(base)) == k
    assert key(b, base) != k  # the template
    assert key(a, dict(base, price=2)) != k  # a column the template names
    assert key(a, dict(base, params={"max_tokens": 3})) != k  # the row's parameters
    assert key(a, dict(base, params={"top_k": 3, "temperature": 0.5, "seed": 1})) != k
    assert key(a, dict(base, params={"max_tokens": 10**6})) == k  # held to the job's: the same output
    msgs = [{"role": "user", "content": TEXTS[0]}]
    assert key(m, {"messages": msgs}) == key(m, {"messages": json.dumps(msgs)})
    assert key(m, {"messages": msgs}) != key(m, {"messages": [{"role": "user", "content": TEXTS[1]}]})


# ----------------------------------------------------------------------------- refused before work starts
def test_a_missing_column_refuses_the_shard_naming_it(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"id": 1, "name": "x"}, {"id": 2, "brand": "y"}])
    pq.write_table(pa.table({"id": [1], "name": ["x"]}), tmp_path / "b.parquet")
    shards = resolve_shards(InputConfig(uri=str(tmp_path / "a.jsonl")), columns=["name", "brand"], list_columns=True)
    assert shards[0].columns == ("id", "name", "brand")
    for f in ("a.jsonl", "b.parquet"):
        with pytest.raises(InputError, match="'colour'.*task.prompt_template"):
            resolve_shards(InputConfig(uri=str(tmp_path / f)), columns=["name", "colour"])


def test_messages_column_is_the_generate_jobs():
    with pytest.raises(ConfigError, match="generate"):
        load_config(None, ["input.messages_column=m"])


def test_a_template_naming_a_missing_column_exits_2_before_ray_starts(tmp_path):
    from test_cli import _run

    out = tmp_path / "out"
    r = _run([str(REPO / "jobs" / "generate.py"), "--config", str(REPO / "configs" / "generate.yaml"),
              "--set", "task.prompt_template='{name} in {colour}'", "--output", str(out)], timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "'colour'" in r.stderr and "catalog.jsonl" in r.stderr
    assert "Traceback" not in r.stderr and "Ray" not in r.stderr and not out.exists()


# ----------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_the_generate_job_end_to_end_and_its_reuse(ray_local, tiny_models, tmp_path):
    from pipeline.run import run_job

    rows = [{"id": f"p{i}", "name": f"item {i}", "brand": "acme", "price": 3 + i, "text": TEXTS[i],
             "extra": {"k": i}, "params": {"max_tokens": 4} if i == 1 else None} for i in range(4)]
    rows.append({"id": "bad", "name": "x", "brand": None, "price": 1, "text": "t", "params": {"nope": 1}})
    write_jsonl(tmp_path / "in" / "a.jsonl", rows)
    sets = ["task.name=generate", f"task.prompt_template={json.dumps(TEMPLATE)}", "input.params_column=params"]
    first = job_config(tiny_models, str(tmp_path / "in"), str(tmp_path / "o1"), overrides=sets)
    s1 = run_job(first, progress=False)
    t = pq.read_table(tmp_path / "o1")
    assert t.column_names[:len(OUTPUT_SCHEMA)] == OUTPUT_SCHEMA.names
    assert t.column_names[len(OUTPUT_SCHEMA):] == ["name", "brand", "price", "text", "extra", "params"]
    got = {r["id"]: r for r in t.to_pylist()}
    assert s1["rows"] == 5 and s1["errors"] == 1 and "column 'brand' is null" in got["bad"]["error"]
    assert got["p1"]["new_tokens"] == 4 and got["p1"]["max_tokens_used"] == 4
    assert got["p2"]["extra"] == '{"k": 2}' and got["p2"]["price"] == "5" and got["p2"]["error"] is None
    # a later run with one row's column and another's parameters changed decodes only those two again
    rows[0]["name"] = "item zero"
    rows[2]["params"] = {"max_tokens": 2}
    write_jsonl(tmp_path / "in" / "a.jsonl", rows)
    second = job_config(tiny_models, str(tmp_path / "in"), str(tmp_path / "o2"),
                        overrides=sets + [f"output.previous={tmp_path / 'o1'}"])
    s2 = run_job(second, progress=False)
    got2 = {r["id"]: r for r in pq.read_table(tmp_path / "o2").to_pylist()}
    assert s2["reused_rows"] == 2
    assert got2["p0"]["reused_from"] is None and got2["p2"]["reused_from"] is None
    assert got2["p1"]["reused_from"] and got2["p3"]["reused_from"]
    assert got2["p1"]["output_token_ids"] == got["p1"]["output_token_ids"] and got2["p1"]["max_tokens_used"] == 4
    assert got2["p2"]["new_tokens"] == 2


# ----------------------------------------------------------------------------- structured rows
CHOICE = {"type": "choice", "choice": ["the cat sat", "a storm hit"]}


@pytest.fixture(scope="module")
def byte_models(tmp_path_factory):
    """A tiny pair with a byte-level tokenizer (which the grammar library reads)."""
    from tiny import make_byte_tokenizer, make_model_pair

    target, drafter = make_model_pair(tmp_path_factory.mktemp("bytes"), tokenizer=make_byte_tokenizer())
    return {"target": target, "drafter": drafter}


@pytest.fixture(scope="module")
def byte_actor(byte_models, tmp_path_factory):
    cfg = job_config(byte_models, "unused", str(tmp_path_factory.mktemp("o")),
                     overrides=["task.name=generate", f"task.prompt_template={json.dumps(TEMPLATE)}",
                                "task.chat_template=false", "input.params_column=params",
                                "generation.max_new_tokens=16"])
    return GenerateActor(cfg.model_dump(), device="cpu", carry=["name", "brand", "price", "text", "params"])


def test_structured_rows_per_row_and_bad_formats_are_row_errors(byte_actor):
    actor = byte_actor
    base = {"name": "A", "brand": "b", "price": 1, "text": TEXTS[0]}
    rows = [dict(base, params={"response_format": CHOICE}),
            dict(base, params={"response_format": CHOICE, "max_tokens": 1}),
            dict(base, params={"response_format": {"type": "regex"}}),
            dict(base, params={"response_format": {"type": "json_schema", "json_schema": {
                "name": "bad", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}}),
            dict(base)]
    out = actor(_batch(rows)).to_pylist()
    assert out[0]["error"] is None and out[0]["finish_reason"] == "stop"
    assert out[0]["output_valid"] is True and json.loads(out[0]["output_json"]) in CHOICE["choice"]
    assert out[0]["output_text"] in CHOICE["choice"]
    # cut by its budget before the choice closes: marked, never silently invalid
    assert out[1]["finish_reason"] == "length" and out[1]["output_valid"] is False and out[1]["output_json"] is None
    assert "params.response_format" in out[2]["error"] and "regex" in out[2]["error"]
    assert "bad" in out[3]["error"] and out[3]["new_tokens"] is None
    assert out[4]["error"] is None and out[4]["output_valid"] is None and out[4]["output_json"] is None


def test_a_job_wide_format_the_library_refuses_is_refused_naming_it(byte_models, tmp_path):
    from pipeline.processor import check_generation

    good = job_config(byte_models, "unused", str(tmp_path), overrides=[f"generation.response_format={json.dumps(CHOICE)}"])
    assert check_generation(good).response_format == CHOICE
    bad = '{type: regex, regex: "a(b"}'
    cfg = job_config(byte_models, "unused", str(tmp_path), overrides=[f"generation.response_format={bad}"])
    with pytest.raises(ConfigError, match="generation.response_format.*regex") as e:
        check_generation(cfg)
    assert "tokenizer" not in str(e.value)
    with pytest.raises(ConfigError, match="response_format"):
        job_config(byte_models, "unused", str(tmp_path), overrides=["generation.response_format={type: xml}"])


def test_logprobs_come_back_per_token(make_actor):
    actor = make_actor("generation.logprobs=2")
    out = actor(_batch([{"name": "A", "brand": "b", "price": 1, "text": TEXTS[3]}])).to_pylist()[0]
    lp = out["output_logprobs"]
    assert len(lp) == out["new_tokens"] and [t["token_id"] for t in lp] == out["output_token_ids"]
    assert all(len(t["top"]) == 2 and t["top"][0]["logprob"] >= t["logprob"] - 1e-9 and t["logprob"] <= 0 for t in lp)
