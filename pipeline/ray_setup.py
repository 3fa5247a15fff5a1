"""Ray set-up for a job or a processor: joining or starting Ray, the console's Ray Data
messages, and the resource plan of the actor pool.

Resource plan.  The read, repartition and write stages ask Ray for no CPU (they are I/O
and slicing), so they never wait behind an actor pool that holds every CPU
(``num_actors x cpus_per_actor`` = the cluster's CPUs, the normal plan on a GPU node: one
actor per GPU).  A pool whose smallest size asks for more CPUs or GPUs than the cluster
has (or than any one node has, per actor) is refused with the numbers (:class:`PlanError`;
on a cluster that may autoscale it is only logged).  A ``[min, max]`` pool
(``compute.num_actors``) reserves the real ``cpus_per_actor`` (and ``gpus_per_actor``) per
actor, so it grows only as that much becomes free (:func:`pool_plan`); a ``max`` more than
the cluster holds now is logged: it grows as nodes join (docs/scheduling.md).

Load facts.  Each actor of the pool posts what its load did (its models' CPU plans:
:attr:`pipeline.engine.loop.StepEngine.cpu_plans`) to a small actor the driver opens for the
pool, the *load board* (:func:`open_load_board`, :func:`post_load_facts`), which the driver reads
for the run summary.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from pipeline.config import RAY_RESOURCE_UNIT, JobConfig, JobRefused

log = logging.getLogger("specbatch")
REPO_ROOT = Path(__file__).resolve().parents[1]


class PlanError(JobRefused):
    """The actor pool asks for more CPUs or GPUs than the cluster (or any one node) has."""


def init_ray(cfg: JobConfig) -> bool:
    """Join a cluster (``ray.address`` or ``RAY_ADDRESS``, as under ``ray job submit``) or
    start an embedded Ray.  Does nothing when Ray is already initialized (tests, notebooks).

    ``ray.init`` replaces the process's SIGTERM handler (with one that exits at once); the
    handler the caller had installed stays in place while Ray starts (:func:`_sigterm_kept`)
    and is put back after (see pipeline.cli: interrupts).

    Returns:
        True when this call started an embedded Ray (its resources are all there will be).
    """
    import ray

    if ray.is_initialized():
        return False
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    _ray_errors_in_one_line()
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if on_main else None
    try:
        if address:
            with _sigterm_kept(previous):
                ray.init(address=address, log_to_driver=True)
            return False
        # Embedded: workers inherit this environment, so they can import pipeline/ and actors/.
        root = str(REPO_ROOT)
        pp = os.environ.get("PYTHONPATH", "")
        if root not in pp.split(os.pathsep):
            os.environ["PYTHONPATH"] = root + (os.pathsep + pp if pp else "")
        # Ray >= 2.5x turns token authentication on for a new local cluster (RAY_AUTH_MODE
        # unset) and warns that it did: that is the setting we want, so the warning is noise.
        logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(_TokenAuthDefault())
        # Actors' own output (a traceback when one dies loading a model, once per restart)
        # goes to Ray's log files, not the job's console: the job reports failures itself.
        with _sigterm_kept(previous):
            ray.init(include_dashboard=False, log_to_driver=False)
        return True
    finally:
        if on_main and callable(previous):
            signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _sigterm_kept(handler) -> Iterator[None]:
    """While Ray starts, the caller's SIGTERM handler (``handler``, when it is one: the job's,
    pipeline.cli) stays the process's, in place of the ones ``ray.init`` installs (Ray's
    driver handler exits with status 15 and no line; its embedded node's drains for up to
    30 s first).  A SIGTERM that comes while ``ray.init`` runs is held until it returns (an
    exception raised inside it, in the middle of an import or of starting the node, would
    leave half a Ray behind to fail at exit), then given to ``handler``: the job stops as at
    any other time, one line and exit 143.  A second SIGTERM meanwhile is given at once.
    With no handler of the caller's (a library user), Ray's are installed as usual."""
    if not callable(handler) or threading.current_thread() is not threading.main_thread():
        yield
        return
    import ray._private.utils as ray_utils

    original = getattr(ray_utils, "set_sigterm_handler", None)
    held: list[int] = []

    def hold(signum, frame) -> None:
        if held:
            handler(signum, frame)
        held.append(signum)

    def keep(sigterm_handler) -> None:
        log.debug("Ray's SIGTERM handler not installed: the job's stays")

    import ray._private.ray_constants as ray_constants

    if original is not None:  # (another Ray version: its handlers are replaced afterwards, by init_ray)
        ray_utils.set_sigterm_handler = keep
    # the driver's C++ core worker would install its failure-signal handler for SIGTERM too
    # (it prints "*** SIGTERM received ***" and aborts, exit -6); Ray's processes keep theirs
    no_cpp_handler = getattr(ray_constants, "RAY_DISABLE_FAILURE_SIGNAL_HANDLER", None)
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    signal.signal(signal.SIGTERM, hold)
    try:
        yield
    finally:
        if original is not None:
            ray_utils.set_sigterm_handler = original
        ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = no_cpp_handler
        signal.signal(signal.SIGTERM, handler)
        if held:
            handler(held[0], None)


def _ray_errors_in_one_line() -> None:
    """Ray's driver prints every error the cluster publishes to it whole, on stdout: a raylet
    that died comes with the last 20 lines of its C++ log and state dumps (about 50 lines),
    in the middle of the job's console and of its JSON summary; so does each worker that dies.
    Each such error becomes one INFO line of the job's log instead, once: its first line, and
    where Ray's logs are (the job then fails or goes on, and says so itself in its one line).
    Ray's worker output (``log_to_driver``) is left as it is.  Ray prints these errors from its private ``print_to_stdstream``; with
    another Ray that has none, nothing changes."""
    import ray._private.worker as ray_worker

    original = getattr(ray_worker, "print_to_stdstream", None)
    if original is None or getattr(original, "specbatch_one_line", False):
        return

    said: set[str] = set()  # (Ray publishes a dead raylet's error once per subscriber: say it once)

    def one_line(data, ignore_prefix):
        if not isinstance(data, dict) or data.get("pid") != "raylet":  # (published errors only)
            return original(data, ignore_prefix)
        node = getattr(ray_worker, "_global_node", None)
        try:
            where = node.get_logs_dir_path() if node is not None else None
        except Exception:  # noqa: BLE001 - the path is an aid to the line only
            where = None
        for message in data.get("lines") or ():
            text = " ".join(str(message).split("\n", 1)[0].split())
            text = text.split(" Last ", 1)[0] if "Raylet is terminated" in text else text
            text = text.split("Traceback (most recent call last)", 1)[0].rstrip(" :")  # (a task's error: its
            text = text[: -len(" Error")] if text.endswith(" Error") else text  # traceback is in the log)
            if text in said:
                continue
            said.add(text)
            log.info("Ray: %s (the rest is in Ray's logs%s)", text[:400], f", {where}" if where else "")

    one_line.specbatch_one_line = True
    ray_worker.print_to_stdstream = one_line


class _TokenAuthDefault(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Token authentication is enabled for this Ray cluster")


def check_resource_plan(cfg: JobConfig, embedded: bool) -> None:
    """Refuse an actor pool the cluster can never hold.

    A ``[min, max]`` pool is checked at its ``min`` (the size it must reach to start); a
    ``max`` the cluster cannot hold now is logged (the pool grows as nodes join).

    Raises:
        PlanError: ``min x cpus_per_actor`` CPUs (or ``x gpus_per_actor`` GPUs) are more
            than the cluster has, or one actor's share is more than any one node has; only
            logged when joining a cluster, which an autoscaler may grow.
    """
    import ray

    c = cfg.compute
    total = ray.cluster_resources()
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    problems, room = [], []
    size = c.min_actors if c.min_actors == c.max_actors else f"{c.min_actors} (the min of [{c.min_actors}, {c.max_actors}])"
    for res, per_actor, key in (("CPU", c.cpus_per_actor, "cpus_per_actor"), ("GPU", c.gpus_per_actor, "gpus_per_actor")):
        if not per_actor:
            continue
        need, have = c.min_actors * per_actor, total.get(res, 0)
        if need > have:
            problems.append(f"compute.num_actors={size} x compute.{key}={per_actor:g} = {need:g} {res}s, "
                            f"but the cluster has {have:g}")
        elif c.max_actors * per_actor > have:
            room.append(f"{int(have // per_actor)} actors' {res}s")
        biggest = max((n.get(res, 0) for n in nodes), default=0)
        if nodes and per_actor > biggest:
            problems.append(f"compute.{key}={per_actor:g} {res}s per actor, but no node has more than {biggest:g}")
    if room and not problems:
        log.info("the actor pool [%d, %d] starts with %d actors; the cluster holds %s now: it grows to %d as "
                 "resources allow (nodes joining an autoscaling cluster)", c.min_actors, c.max_actors,
                 c.min_actors, " and ".join(room), c.max_actors)
    if not problems:
        return
    message = "the actor pool cannot be scheduled: " + "; ".join(problems)
    if embedded:
        raise PlanError(message + "; lower compute.num_actors or the per-actor resources")
    log.warning("%s; waiting for the cluster to grow (up to compute.actor_start_timeout_s=%d s)",
                message, c.actor_start_timeout_s)


#: Ray Data console messages that say nothing to a user of this job (they still reach
#: Ray Data's log file): our own progress bar replaces Ray Data's, the run's end is logged
#: by the job itself (Ray Data's "execution finished" also shows on an interrupt), and a
#: failure is reported by the job in one line, its traceback in a log file (pipeline.cli),
#: where Ray Data would print the stack trace again (a 30-line one when an actor died) and
#: ask for a Ray bug report.
_RAY_DATA_NOISE = ("Progress bars disabled", "Progress bars for operators disabled", "Exception occurred in",
                   "Full stack trace", "An exception was raised from a task of operator")
#: ... and those that name the operator first (``MapBatches(GenerateActor): actors died ...``)
_RAY_DATA_NOISE_WITHIN = (": actors died during initialization",)


class _QuietRayData(logging.Filter):
    """Drops Ray Data's info records and known noise; passes every other logger's records
    (a handler of ``ray.data`` may be shared with the root logger, e.g. under pytest)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name != "ray.data" and not record.name.startswith("ray.data."):
            return True
        msg = str(record.msg)
        return (record.levelno >= logging.WARNING and not msg.startswith(_RAY_DATA_NOISE)
                and not any(n in msg for n in _RAY_DATA_NOISE_WITHIN))


def quiet_ray_data_console() -> None:
    """Show only Ray Data's warnings and errors on the console (minus the known noise)."""
    for handler in logging.getLogger("ray.data").handlers:
        if not isinstance(handler, logging.FileHandler) and not any(isinstance(f, _QuietRayData) for f in handler.filters):
            handler.addFilter(_QuietRayData())


def zero_cpu(ds):
    """Make the repartition stage ask for no CPU.  ``Dataset.repartition`` takes no resource
    arguments and its tasks default to 1 CPU, which an actor pool holding every CPU would
    never leave free (the job hung there); its logical operator carries the remote args."""
    args = getattr(getattr(getattr(ds, "_logical_plan", None), "dag", None), "ray_remote_args", None)
    if not isinstance(args, dict):
        raise RuntimeError("this Ray version's repartition operator has no ray_remote_args: "
                           "pipeline.ray_setup.zero_cpu needs updating")
    args["num_cpus"] = 0
    return ds


@dataclass(frozen=True)
class PoolPlan:
    """The actor pool as Ray Data runs it.

    Attributes:
        min_size, max_size: the pool's size (equal: a fixed pool).
        cpus: the CPUs each actor reserves from Ray (it still runs ``compute.cpus_per_actor``
            torch threads).
        gpus: the GPUs each actor reserves (``compute.gpus_per_actor``).
    """

    min_size: int
    max_size: int
    cpus: float
    gpus: float

    def strategy(self):
        """Ray Data's ``ActorPoolStrategy``: ``size=N``, or ``min_size=``/``max_size=``."""
        from ray.data import ActorPoolStrategy

        if self.min_size == self.max_size:
            return ActorPoolStrategy(size=self.min_size)
        return ActorPoolStrategy(min_size=self.min_size, max_size=self.max_size)


def pool_plan(cfg: JobConfig, embedded: bool, cluster_cpus: float | None = None) -> PoolPlan:
    """The actor pool's sizes and the resources each actor reserves (see the module docstring).

    - A ``[min, max]`` pool reserves the real ``compute.cpus_per_actor`` (and GPUs) per actor:
      Ray Data's autoscaling pool adds an actor only when that much is free within its budget,
      so it never runs more actors than the cluster holds at that size, and on an autoscaling
      cluster its demand is real (the cluster grows for it).  On an embedded Ray whose CPUs its
      ``min`` already fills, it cannot grow: it runs as a fixed pool of ``min``.
    - A fixed pool of ``N`` reserves ``compute.cpus_per_actor`` each, or, when the pool would
      hold every CPU of the cluster, ``(cluster CPUs - 1) / N`` (rounded down to Ray's unit of
      0.0001), so that one stays free for the stages before it (each still runs
      ``cpus_per_actor`` threads; an INFO line says so).

    Args:
        embedded: whether the cluster's resources are all there will be (an embedded Ray).
        cluster_cpus: the cluster's CPUs (None: asked of Ray).
    """
    c = cfg.compute
    if cluster_cpus is None:
        import ray

        cluster_cpus = ray.cluster_resources().get("CPU", 0)
    lo, hi, per = c.min_actors, c.max_actors, c.cpus_per_actor
    if lo < hi:
        if not (embedded and lo * per >= cluster_cpus):
            return PoolPlan(lo, hi, per, c.gpus_per_actor)
        log.info("the actor pool [%d, %d] at its min already holds all %g CPUs of this Ray: it runs %d actors "
                 "and does not grow", lo, hi, cluster_cpus, lo)
    if lo * per < cluster_cpus or cluster_cpus <= 0:
        return PoolPlan(lo, lo, per, c.gpus_per_actor)
    share = math.floor(max(0.0, (cluster_cpus - 1) / lo) / RAY_RESOURCE_UNIT) * RAY_RESOURCE_UNIT
    log.info("the actor pool (%d x %g CPUs) would hold all %g CPUs of the cluster: each actor reserves %.4g "
             "so that one stays free for the stages before it (it still runs %g threads)",
             lo, per, cluster_cpus, share, per)
    return PoolPlan(lo, lo, share, c.gpus_per_actor)


def is_local_cluster() -> bool:
    """Whether Ray runs on this machine alone (its resources are all there will be)."""
    import ray

    try:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
    except Exception:  # noqa: BLE001
        return False
    return len(nodes) == 1 and not os.environ.get("RAY_ADDRESS")




class _LoadBoard:
    """What the actors' loads did, posted once per actor (a Ray actor holding a list)."""

    def __init__(self) -> None:
        self.posts: list = []

    def post(self, facts) -> None:
        self.posts.append(facts)

    def read(self) -> list:
        return list(self.posts)


#: how long a post to the load board or the driver's read may wait (seconds): long, since a node
#: whose every core is busy (a job's, or a test suite's workers) can keep the board's actor waiting
BOARD_TIMEOUT_S = 300


def open_load_board():
    """A new load board (an unnamed actor asking for no CPU) for one actor pool: the caller
    hands the returned handle to each actor (:func:`post_load_facts`) and reads it with
    :func:`read_load_board`.  Unnamed, one per pool: two runs in one driver process (threads,
    a test session) never see or clear each other's posts, and the board lives as long as
    the caller holds its handle."""
    import ray

    return ray.remote(num_cpus=0)(_LoadBoard).remote()


def post_load_facts(facts, board) -> bool:
    """Post ``facts`` (plain data) to ``board`` (the handle :func:`open_load_board` returned,
    given to the actor by the processor); ``False`` where there is none (an actor built
    outside a processor: the node benchmark, a test) or the post failed (logged)."""
    if board is None:
        return False
    try:
        import ray

        ray.get(board.post.remote(facts), timeout=BOARD_TIMEOUT_S)
        return True
    except Exception:  # noqa: BLE001 - the facts are a record: never a reason to fail a load
        log.warning("could not post this actor's load facts to the driver", exc_info=True)
        return False


def read_load_board(board) -> list:
    """Every post on ``board`` (:func:`open_load_board`; ``[]`` for ``None`` or a board that
    cannot be read: logged)."""
    if board is None:
        return []
    try:
        import ray

        return ray.get(board.read.remote(), timeout=BOARD_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - the summary goes on without them
        log.warning("could not read the actors' load facts", exc_info=True)
        return []
