"""The output lease (pipeline.output.lease), on local disk and on moto S3: one holder at a time
(also when many runs race for it), a second run refused naming the holder and its last
heartbeat, a stale lease taken over with a warning (and only by one of several takers), a
holder that lost its lease publishes nothing (``check`` raises) and never removes the
new holder's lease, a SIGKILLed holder's lease expires, and a store that ignores
conditional writes is detected and named."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest
from fsspec.implementations.memory import MemoryFileSystem

from pipeline.output.lease import LEASE, LeaseHeld, LeaseLost, LeaseUnreadable, OutputLease
from pipeline.retry import open_fs, retrying
from pipeline.storage import MTIME_KEYS
from pipeline_testkit import REPO


class Place:
    """One output folder, local or on moto S3, and leases on it."""

    def __init__(self, kind, tmp_path, moto):
        self.kind = kind
        if kind == "local":
            self.url, self.options = str(tmp_path / "out"), {}
        else:
            self.client = moto["client"]
            self.client.create_bucket(Bucket="leases")
            self.key = f"{tmp_path.name}-{uuid.uuid4().hex[:6]}"
            self.url, self.options = f"s3://leases/{self.key}", moto["options"]

    def lease(self, run_id, timeout_s=60.0, clock=time.time, fs=None, fingerprint="fp-" + "0" * 13):
        got, root = open_fs(self.url, self.options)
        return OutputLease(fs or got, root, run_id, url=self.url, io=retrying(None), timeout_s=timeout_s,
                           config_fingerprint=fingerprint, clock=clock)

    def read(self):
        if self.kind == "local":
            p = os.path.join(self.url, LEASE)
            return json.loads(open(p).read()) if os.path.exists(p) else None
        try:
            body = self.client.get_object(Bucket="leases", Key=f"{self.key}/{LEASE}")["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None
        return json.loads(body)

    def age(self, seconds):
        """Make the lease ``seconds`` older: its mtime set back (local), or wait (S3's
        LastModified is the server's)."""
        if self.kind == "local":
            p = os.path.join(self.url, LEASE)
            t = os.stat(p).st_mtime - seconds
            os.utime(p, (t, t))
        else:
            time.sleep(seconds)

    def put(self, data: bytes):
        if self.kind == "local":
            os.makedirs(self.url, exist_ok=True)
            open(os.path.join(self.url, LEASE), "wb").write(data)
        else:
            self.client.put_object(Bucket="leases", Key=f"{self.key}/{LEASE}", Body=data)


@pytest.fixture(params=["local", "s3"])
def place(request, tmp_path):
    moto = request.getfixturevalue("moto_s3") if request.param == "s3" else None
    return Place(request.param, tmp_path, moto)


def later(seconds):
    """A clock ``seconds`` ahead of this machine's: every lease looks that much older."""
    return lambda: time.time() + seconds


def test_one_holder_a_second_run_is_refused_naming_it_and_release_frees_it(place):
    a = place.lease("run-aaaa")
    a.acquire()
    try:
        content = place.read()
        assert content["run_id"] == "run-aaaa" and content["pid"] == os.getpid()
        assert content["config_fingerprint"] == "fp-" + "0" * 13 and "@" in content["owner"]
        for _ in range(2):  # refused again and again, never taking it
            with pytest.raises(LeaseHeld, match=r"leased by another run: run run-aaaa of .*@.* \(pid \d+, config "
                                                r"fingerprint fp-0+, started .*\), last heartbeat \d+ s ago"):
                place.lease("run-bbbb").acquire()
        assert place.read()["run_id"] == "run-aaaa"
        a.check()  # still ours
    finally:
        a.release()
    assert place.read() is None
    with place.lease("run-bbbb") as b:  # free again
        assert place.read()["run_id"] == "run-bbbb"
        b.check()
    assert place.read() is None


def test_runs_racing_for_a_free_lease_get_exactly_one_holder(place):
    leases = [place.lease(f"racer-{i}") for i in range(6)]
    start = threading.Barrier(len(leases))
    outcome = {}

    def go(lease):
        start.wait()
        try:
            lease.acquire()
            outcome[lease.run_id] = "held"
        except LeaseHeld:
            outcome[lease.run_id] = "refused"

    threads = [threading.Thread(target=go, args=(x,)) for x in leases]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    try:
        winners = [r for r, o in outcome.items() if o == "held"]
        assert len(outcome) == 6 and len(winners) == 1, outcome
        assert place.read()["run_id"] == winners[0]
    finally:
        [x.release() for x in leases]
    assert place.read() is None


def test_a_stale_lease_is_taken_over_with_a_warning_and_the_old_holder_publishes_nothing(place, caplog):
    old = place.lease("old-run", timeout_s=30)
    old.acquire()
    old._stop.set()  # its heartbeat stops (a hung or dead process)
    # another run 31 s later: the lease has not beaten for longer than the bound
    new = place.lease("new-run", timeout_s=30, clock=later(31))
    with caplog.at_level("WARNING", logger="specbatch"):
        new.acquire()
    try:
        assert any("took over the stale lease of run old-run" in r.getMessage() for r in caplog.records)
        assert place.read()["run_id"] == "new-run"
        with pytest.raises(LeaseLost, match="lost its lease .*now belongs to run new-run"):
            old.check()
        assert old.beat() is False  # and its heartbeat never overwrites the new holder's
        assert place.read()["run_id"] == "new-run"
        old.release()  # must not remove the new holder's lease
        assert place.read()["run_id"] == "new-run"
        new.check()
    finally:
        new.release()
        old.release()
    assert place.read() is None


def test_only_one_of_several_takers_of_a_stale_lease_wins(place):
    dead = place.lease("dead-run", timeout_s=1)
    dead.acquire()
    dead._stop.set()
    dead.held = False  # it died: it never releases
    place.age(3.2)
    takers = [place.lease(f"taker-{i}", timeout_s=2.5) for i in range(5)]
    start = threading.Barrier(len(takers))
    outcome = {}

    def go(lease):
        start.wait()
        try:
            lease.acquire()
            outcome[lease.run_id] = "held"
        except LeaseHeld:
            outcome[lease.run_id] = "refused"

    threads = [threading.Thread(target=go, args=(x,)) for x in takers]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    try:
        winners = [r for r, o in outcome.items() if o == "held"]
        assert len(outcome) == 5 and len(winners) == 1, outcome
        assert place.read()["run_id"] == winners[0]
    finally:
        [x.release() for x in takers]
        if dead.backend.__class__.__name__ == "LocalLeaseStore" and dead.backend.fd is not None:
            os.close(dead.backend.fd)


def test_the_heartbeat_keeps_a_live_lease_from_going_stale(place):
    with place.lease("live-run", timeout_s=1.5) as live:  # beats every 0.25 s
        time.sleep(2.5)  # longer than the bound
        with pytest.raises(LeaseHeld, match="leased by another run: run live-run"):
            place.lease("other", timeout_s=1.5).acquire()
        assert live.beats >= 4
        live.check()


def test_a_lease_abandoned_after_a_storage_failure_is_retaken_at_once_by_this_process_only(place):
    failed = place.lease("failed-run", timeout_s=60)
    failed.acquire()
    failed.abandon()  # the storage failed: nothing touched
    assert place.read()["run_id"] == "failed-run"
    with place.lease("rerun", timeout_s=60):  # the same process: that run is known to be over
        assert place.read()["run_id"] == "rerun"
    # another process's fresh lease is never taken that way
    other = dict(place.lease("x").content(), run_id="other-process-run", process="another process")
    place.put(json.dumps(other).encode())
    with pytest.raises(LeaseHeld, match="run other-process-run"):
        place.lease("third", timeout_s=60).acquire()


def test_a_holder_whose_lease_was_removed_publishes_nothing(place):
    with place.lease("victim") as lease:
        if place.kind == "local":
            os.unlink(os.path.join(place.url, LEASE))
        else:
            place.client.delete_object(Bucket="leases", Key=f"{place.key}/{LEASE}")
        with pytest.raises(LeaseLost, match=f"{LEASE} was removed"):
            lease.check()


def test_a_holder_whose_heartbeat_stopped_reaching_the_storage_stops_publishing(place):
    with place.lease("quiet", timeout_s=4) as lease:
        lease.last_confirmed -= 3  # no confirmed beat for 3 s: more than half the bound
        with pytest.raises(LeaseLost, match="heartbeat has not reached the storage for 3 s"):
            lease.check()


@pytest.mark.parametrize("content", [b"", b"{not json", b'{"run_id": "x"}', b"\xff\xfe"])
def test_a_lease_file_that_is_not_ours_is_refused_and_left_alone(place, content):
    place.put(content)
    expect = LeaseHeld if content == b"" and place.kind == "local" else LeaseUnreadable
    with pytest.raises(expect):
        place.lease("run", timeout_s=600).acquire()
    if place.kind == "local":
        assert open(os.path.join(place.url, LEASE), "rb").read() == content
    else:
        assert place.client.get_object(Bucket="leases", Key=f"{place.key}/{LEASE}")["Body"].read() == content


def test_a_symlinked_local_lease_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    target = tmp_path / "elsewhere.json"
    target.write_text("{}")
    (out / LEASE).symlink_to(target)
    place = Place("local", tmp_path, None)
    with pytest.raises(LeaseUnreadable, match="symlink"):
        place.lease("run").acquire()
    assert target.read_text() == "{}"


def test_a_sigkilled_holder_s_lease_expires(tmp_path):
    """A real process takes the lease and is SIGKILLed: until the bound its lease refuses
    others; after it, the next run takes it over.  (Local disk; on S3 the same expiry is
    tests above: a stale lease taken over, by one of several takers.)"""
    place = Place("local", tmp_path, None)
    script = (
        "import sys, time; sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + '/tests/pipeline');"
        "import json; from pipeline.output.lease import OutputLease; from pipeline.retry import open_fs;"
        "opts = json.loads(sys.argv[3]); fs, root = open_fs(sys.argv[2], opts);"
        "l = OutputLease(fs, root, 'killed-run', url=sys.argv[2], timeout_s=2.0); l.acquire();"
        "print('held', flush=True); time.sleep(600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, str(REPO), place.url, json.dumps(place.options)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        time.sleep(0.6)  # a couple of beats
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        killed_at = time.time()
        with pytest.raises(LeaseHeld, match="run killed-run"):
            place.lease("next", timeout_s=2.0).acquire()
        time.sleep(max(0.0, killed_at + 3.2 - time.time()))  # past the bound (S3 times are whole seconds)
        with place.lease("next", timeout_s=2.0):
            assert place.read()["run_id"] == "next"
    finally:
        if proc.poll() is None:
            proc.kill()


class _IgnoresConditions:
    """An s3fs filesystem whose store ignores If-None-Match / If-Match (as some older
    S3-compatible servers do): the conditions are dropped before the request."""

    def __init__(self, fs):
        self._fs = fs

    def __getattr__(self, name):
        return getattr(self._fs, name)

    def call_s3(self, method, **kw):
        kw.pop("IfNoneMatch", None)
        kw.pop("IfMatch", None)
        return self._fs.call_s3(method, **kw)


def test_a_store_that_ignores_conditional_writes_is_named_and_the_lease_still_refuses(tmp_path, moto_s3, caplog):
    place = Place("s3", tmp_path, moto_s3)
    fs, _ = open_fs(place.url, place.options)
    loose = _IgnoresConditions(fs)
    a = place.lease("first", fs=loose)
    with caplog.at_level("WARNING", logger="specbatch"):
        a.acquire()
    try:
        assert any("ignores conditional writes (If-None-Match and If-Match)" in r.getMessage() for r in caplog.records)
        with pytest.raises(LeaseHeld, match="run first"):
            place.lease("second", fs=loose).acquire()
        # a writer that replaced it behind our back is found at the next check
        place.put(json.dumps({"lease": "specbatch output lease", "run_id": "intruder", "owner": "x@y"}).encode())
        with pytest.raises(LeaseLost, match="now belongs to run intruder"):
            a.check()
    finally:
        a.release()
    assert place.read()["run_id"] == "intruder"  # not ours: left alone


class _NoTimes(MemoryFileSystem):
    """A store whose ``info()`` reports no modification time (the generic lease then ages a
    lease by the holder's own ``heartbeat_at``)."""

    protocol = "memory-without-times"

    def info(self, path, **kwargs):
        return {k: v for k, v in super().info(path, **kwargs).items() if k not in MTIME_KEYS}


@pytest.mark.parametrize("store_times", [True, False], ids=["the-store-s-time", "the-heartbeat-stamp"])
def test_a_generic_store_s_lease_ages_by_the_store_s_time_else_by_the_holder_s_heartbeat(store_times):
    """The holder's clock runs 1000 s behind: its ``heartbeat_at`` says its lease is stale,
    the store's modification time says it was written now.  The store's time wins where the
    store reports one (``pipeline.storage.modified_at``), the stamp is read otherwise."""
    fs = MemoryFileSystem() if store_times else _NoTimes()
    root = f"/leases-{uuid.uuid4().hex[:8]}"

    def lease(run_id, clock=time.time):
        return OutputLease(fs, root, run_id, url=f"memory://{root}", io=retrying(None), timeout_s=60.0, clock=clock)

    old = lease("old", clock=lambda: time.time() - 1000)
    old.acquire()
    try:
        new = lease("new")
        if store_times:
            with pytest.raises(LeaseHeld, match="run old"):
                new.acquire()
        else:
            new.acquire()  # stale by its stamp: taken over
            try:
                with pytest.raises(LeaseLost, match="now belongs to run new"):
                    old.check()
            finally:
                new.release()
    finally:
        old.release()


def test_a_lease_that_cannot_be_written_is_a_refusal_and_a_passing_fault_is_not(tmp_path, monkeypatch):
    """``OutputWriter.acquire_lease``: a location where no lease can be created is refused
    naming it (exit 2); a transient storage fault is raised as it is (exit 1: a rerun may
    succeed), as every check before work does (``pipeline.storage.raise_refusal``)."""
    from pipeline.config import OutputConfig
    from pipeline.output import OutputError, OutputWriter
    from pipeline.retry import StorageError

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OutputError, match=r"output '.*/file/out' is not writable: NotADirectoryError"):
        OutputWriter(OutputConfig(uri=str(blocker / "out"))).acquire_lease()
    out, makedirs = tmp_path / "out", os.makedirs

    def stalls(path, *args, **kwargs):
        if str(path) == str(out):
            raise TimeoutError("the disk did not answer")
        return makedirs(path, *args, **kwargs)

    monkeypatch.setattr(os, "makedirs", stalls)
    with pytest.raises(StorageError, match="the disk did not answer") as got:
        OutputWriter(OutputConfig(uri=str(out)), retry={"attempts": 2, "initial_backoff_s": 0}).acquire_lease()
    assert got.value.transient and not isinstance(got.value, OutputError)
