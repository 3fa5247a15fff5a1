"""Fixtures of the pipeline tests: tiny random models (built offline), a local Ray."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))  # tiny.py, pipeline_testkit.py

from tiny import make_model_pair  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """``{"target": path, "drafter": path}``: a tiny random Llama pair, context 256 tokens."""
    root = tmp_path_factory.mktemp("models")
    target, drafter = make_model_pair(root)
    return {"target": target, "drafter": drafter}


@pytest.fixture(scope="session")
def ray_local():
    """An embedded Ray (2 CPUs, no dashboard) for the session; shut down at the end."""
    import ray

    pp = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = str(REPO) + (os.pathsep + pp if pp else "")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=300 * 2**20,
             configure_logging=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def moto_s3():
    """An S3-compatible server (moto) on 127.0.0.1 for the session: ``{"endpoint", "client",
    "options"}``; ``options`` are fsspec storage options for it (a JSON string for ``--set``)."""
    import json

    import boto3
    from moto.server import ThreadedMotoServer

    from pipeline_testkit import free_port

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing-key",
                          aws_secret_access_key="testing-secret", region_name="us-east-1")
    options = {"key": "testing-key", "secret": "testing-secret",
               "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    yield {"endpoint": endpoint, "client": client, "options": options, "options_json": json.dumps(options)}
    server.stop()
