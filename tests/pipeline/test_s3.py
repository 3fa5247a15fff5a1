"""Object storage for real: an S3-compatible server (moto) on 127.0.0.1; prompt shards read
from a bucket, Parquet written back, the output read with pyarrow's own S3 client."""

import json

import pytest

from pipeline_testkit import TEXTS, free_port, job_config
from pipeline.input import InputError
from pipeline.run import run_job

KEY, SECRET = "testing-key", "testing-secret"


@pytest.fixture(scope="module")
def s3_server():
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture(scope="module")
def bucket(s3_server):
    import boto3

    s3 = boto3.client("s3", endpoint_url=s3_server, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
                      region_name="us-east-1")
    s3.create_bucket(Bucket="prompts")
    for i in range(2):
        body = "".join(json.dumps({"id": f"s{i}-{j}", "text": t}) + "\n" for j, t in enumerate(TEXTS[3 * i: 3 * i + 3]))
        s3.put_object(Bucket="prompts", Key=f"in/shard-{i}.jsonl", Body=body.encode())
    return s3


def _opts(endpoint):
    return json.dumps({"key": KEY, "secret": SECRET, "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}})


@pytest.mark.slow
def test_s3_in_s3_out(ray_local, tiny_models, s3_server, bucket):
    opts = _opts(s3_server)
    cfg = job_config(tiny_models, "s3://prompts/in/*.jsonl", "s3://prompts/out/run1",
                     overrides=[f"input.storage_options={opts}", f"output.storage_options={opts}"])
    summary = run_job(cfg, progress=False)
    assert summary["rows"] == 6 and summary["errors"] == 0

    keys = sorted(o["Key"] for o in bucket.list_objects_v2(Bucket="prompts", Prefix="out/run1/")["Contents"])
    run = summary["run_id"]
    assert keys == ["out/run1/_SUCCESS"] + [f"out/run1/_manifest/log/{i:010d}.json" for i in range(4)] + [
        "out/run1/_summary.json", f"out/run1/part-00000-u00000.{run}.parquet", f"out/run1/part-00001-u00000.{run}.parquet"]

    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    fs = pafs.S3FileSystem(access_key=KEY, secret_key=SECRET, endpoint_override=s3_server, scheme="http",
                           region="us-east-1")
    table = pq.read_table("prompts/out/run1", filesystem=fs)
    assert table.num_rows == 6
    import pyarrow as pa

    assert table.schema.field("error").type == pa.string() and table.column("error").null_count == 6  # all succeeded
    assert sorted(table.column("id").to_pylist()) == sorted(f"s{i}-{j}" for i in range(2) for j in range(3))
    assert set(table.column("source_file").to_pylist()) == {"s3://prompts/in/shard-0.jsonl", "s3://prompts/in/shard-1.jsonl"}
    assert all(n > 0 for n in table.column("new_tokens").to_pylist())
    summary_obj = json.loads(bucket.get_object(Bucket="prompts", Key="out/run1/_summary.json")["Body"].read())
    assert summary_obj["rows"] == 6
    assert summary_obj["config"]["output"]["storage_options"]["secret"] == "***"


def test_s3_missing_input_fails_before_models(tiny_models, s3_server, bucket, tmp_path):
    opts = _opts(s3_server)
    cfg = job_config(tiny_models, "s3://prompts/nothing/*.parquet", str(tmp_path / "o"),
                     overrides=[f"input.storage_options={opts}"])
    with pytest.raises(InputError, match="input not found"):
        run_job(cfg, progress=False)


def test_s3_credentials_and_endpoint_from_the_standard_chain(s3_server, bucket, monkeypatch):
    """No storage options: s3fs takes the keys and endpoint from AWS_* variables."""
    import pyarrow as pa

    from pipeline.config import InputConfig, OutputConfig
    from pipeline.input import read_shard, resolve_shards
    from pipeline.output import is_complete
    from pipeline.output import OutputWriter
    from pipeline.schema import OUTPUT_SCHEMA

    for k, v in {"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_ENDPOINT_URL": s3_server,
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    shards = resolve_shards(InputConfig(uri="s3://prompts/in/"))
    assert [s.url for s in shards] == ["s3://prompts/in/shard-0.jsonl", "s3://prompts/in/shard-1.jsonl"]
    assert read_shard(shards[0], InputConfig(uri="s3://prompts/in/")).num_rows == 3
    w = OutputWriter(OutputConfig(uri="s3://prompts/out/chain"))
    w.on_write_start()
    w.write_part(0, pa.Table.from_pylist([{"id": "a"}], schema=OUTPUT_SCHEMA))
    assert not is_complete("s3://prompts/out/chain")
    w.on_write_complete({"rows": 1})
    assert is_complete("s3://prompts/out/chain")
