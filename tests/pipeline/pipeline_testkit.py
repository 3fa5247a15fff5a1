"""Helpers of the pipeline tests (imported by name: ``from pipeline_testkit import ...``)."""

from __future__ import annotations

import io
import json
import socket
import threading
from pathlib import Path

import pyarrow as pa

from pipeline.config import load_config
from pipeline.schema import OUTPUT_SCHEMA
from pipeline.units import Shard, Unit

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


#: a six-row JSONL shard that the output tests' units come from (nothing reads it: its rows are made by :func:`unit_rows`)
SHARD = Shard(index=0, url="/in/rows.jsonl", format="jsonl", num_rows=6, fingerprint="size=60;mtime=1")


def unit_rows(unit: Unit) -> pa.Table:
    """The two output rows a test writes for ``unit`` of :data:`SHARD` (ids ``r<start>``, ``r<start + 1>``)."""
    start = unit.split.start
    return pa.Table.from_pylist([{"id": f"r{i}", "prompt": f"p{i}", "output_text": f"o{i}", "finish_reason": "length",
                                  "new_tokens": 3, "verify_steps": 3, "method": "plain", "error": None,
                                  "source_file": SHARD.url, "source_row": i} for i in range(start, start + 2)],
                                schema=OUTPUT_SCHEMA)


def job_module(name: str):
    """The entry point ``jobs/<name>.py`` as a module (``job_<name>``; loaded once: ``jobs/``
    is no package)."""
    import importlib.util
    import sys

    key = f"job_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, REPO / "jobs" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def job_config(tiny_models: dict, input_uri: str, output_uri: str, *, method: str = "draft_model",
               overrides: list[str] | None = None, **extra_sets):
    """A small JobConfig for the tiny models (1 actor, CPU, 4 rows per batch, 12 new tokens)."""
    sets = [
        f"input.uri={input_uri}",
        f"output.uri={output_uri}",
        f"models.target={tiny_models['target']}",
        f"models.drafter={tiny_models['drafter']}",
        f"method.name={method}",
        "generation.max_new_tokens=12",
        "compute.num_actors=1",
        "compute.rows_per_batch=4",
        "compute.cpus_per_actor=1",
    ]
    return load_config(None, sets + list(overrides or []))


TEXTS = [
    "the cat sat on the mat and looked at the dog",
    "a storm hit the coast on monday and many homes lost power",
    "the council voted to build a new school near the river",
    "scientists found a new species of frog in the forest",
    "the team won the final match after a long season",
    "prices rose again this month as fuel costs went up",
    "the museum opened a new exhibition about ancient ships",
    "local farmers said the dry summer hurt their crops",
]


class PausableProxy:
    """A TCP proxy 127.0.0.1:<port> -> 127.0.0.1:<target>.  ``pause()``: the server is down
    (open connections dropped, new ones closed at once); ``hang()``: the server accepts
    connections but never answers (open and new connections stay open, nothing is relayed)."""

    def __init__(self, target_port: int):
        self.target = target_port
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.paused = threading.Event()
        self.hanging = threading.Event()
        self.held: list[socket.socket] = []
        self.conns: set[socket.socket] = set()
        self.lock = threading.Lock()
        self.refused = 0
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.closed:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            if self.paused.is_set():
                self.refused += 1
                c.close()
                continue
            if self.hanging.is_set():
                self.held.append(c)
                continue
            try:
                u = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                c.close()
                continue
            with self.lock:
                self.conns |= {c, u}
            threading.Thread(target=self._pipe, args=(c, u), daemon=True).start()
            threading.Thread(target=self._pipe, args=(u, c), daemon=True).start()

    def _pipe(self, a, b):
        try:
            while True:
                data = a.recv(65536)
                if not data:
                    break
                if not self.hanging.is_set():
                    b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def pause(self):
        self.paused.set()
        with self.lock:
            conns, self.conns = self.conns, set()
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass

    def hang(self):
        self.hanging.set()

    def resume(self):
        self.paused.clear()
        self.hanging.clear()
        held, self.held = self.held, []
        for c in held:
            c.close()

    def close(self):
        self.closed = True
        self.pause()
        self.sock.close()


def committed(uri, storage_options=None) -> dict:
    """Part name -> manifest entry of every committed unit of the output ``uri``, as the job
    reads them back (the commit log, and the entries of earlier versions)."""
    from pipeline.config import OutputConfig
    from pipeline.output import OutputLocation

    if isinstance(storage_options, str):
        storage_options = json.loads(storage_options)
    cfg = OutputConfig(uri=str(uri), partition_by_date=False, storage_options=storage_options or {})
    return OutputLocation(cfg).read_manifest()


class OutStore:
    """An output folder on local disk or in a moto bucket (``interrupts``): its files, a put, the ids of its rows."""

    def __init__(self, kind, tmp_path, moto):
        self.kind = kind
        if kind == "local":
            self.uri, self.options, self.root = str(tmp_path / "out"), None, tmp_path / "out"
        else:
            self.client = moto["client"]
            try:
                self.client.create_bucket(Bucket="interrupts")
            except self.client.exceptions.BucketAlreadyOwnedByYou:
                pass
            self.uri, self.options = f"s3://interrupts/{tmp_path.name}", moto["options_json"]
            self.prefix = f"{tmp_path.name}/"

    def files(self):
        if self.kind == "local":
            return sorted(str(p.relative_to(self.root)) for p in self.root.rglob("*") if p.is_file()) \
                if self.root.exists() else []
        return sorted(o["Key"][len(self.prefix):] for o in
                      self.client.list_objects_v2(Bucket="interrupts", Prefix=self.prefix).get("Contents", []))

    def committed(self) -> dict:
        """Part name -> manifest entry of every committed unit."""
        return committed(self.uri, self.options)

    def get(self, rel) -> bytes:
        if self.kind == "local":
            return (self.root / rel).read_bytes()
        return self.client.get_object(Bucket="interrupts", Key=self.prefix + rel)["Body"].read()

    def put(self, rel, data):
        if self.kind == "local":
            (self.root / rel).parent.mkdir(parents=True, exist_ok=True)
            (self.root / rel).write_bytes(data)
        else:
            self.client.put_object(Bucket="interrupts", Key=self.prefix + rel, Body=data)

    def ids(self):
        import pyarrow.parquet as pq

        if self.kind == "local":
            return sorted(pq.read_table(self.root).column("id").to_pylist())
        ids = []
        for rel in self.files():
            if rel.startswith("part-"):
                body = self.client.get_object(Bucket="interrupts", Key=self.prefix + rel)["Body"].read()
                ids += pq.read_table(io.BytesIO(body)).column("id").to_pylist()
        return sorted(ids)


def killed_inside_commit(writer, unit, rows) -> None:
    """Write ``unit`` with ``writer`` (an ``OutputWriter``) and kill it inside the unit's commit:
    its data file published, its ``unit`` record never appended (``KeyboardInterrupt``, checked)."""
    import pytest

    append = writer.log.append

    def dies_before_the_record(record):
        if record.kind == "unit":
            raise KeyboardInterrupt("killed between the files and the unit's record")
        return append(record)

    writer.log.append = dies_before_the_record
    with pytest.raises(KeyboardInterrupt):
        writer.write_part(unit, rows)
