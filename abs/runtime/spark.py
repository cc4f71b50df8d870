"""The Spark launcher: the workers of a job run as the tasks of one Spark barrier stage.

::

    from pyspark.sql import SparkSession
    spark = SparkSession.builder.master("local[4]").getOrCreate()
    result = abs.run(flow, executor=abs.SparkExecutor(spark, num_workers=3),
                     checkpoint=abs.CheckpointConfig(interval=1.0), storage="s3://bucket/ckpt")

How it works
============
* ``abs.run`` keeps the coordinator, the split enumerators and the restart loop in the
  driver, exactly as with the local launcher. Only the way the ``P`` worker processes are
  started differs: :class:`SparkExecutor` submits ``P`` tasks as one barrier stage
  (``sc.parallelize(range(P), P).barrier().mapPartitions(...)``), so Spark gang-schedules them
  (all start together or none) on its executors.
* Barrier task ``i`` starts worker ``i`` as a child process of the Spark Python worker, with
  the same bootstrap as a local worker (the driver's control address and the job secret), and
  waits for it. The worker connects back to the driver, publishes its own data-plane address,
  and receives its peers' addresses from the driver: the data plane (authenticated TCP,
  Arrow IPC, bounded buffers) is the local launcher's, unchanged. ``BarrierTaskContext``'s
  ``allGather`` is not needed (it costs ~1 s per call).
* A child process, not the task's own interpreter: a worker killed with ``kill -9`` fails just
  its task (the task sees the exit status and raises), the child dies with the task when
  Spark kills it (``PR_SET_PDEATHSIG``), and nothing a worker leaves behind (threads, sockets)
  can leak into the reused Spark Python worker.
* Failure: a failed task fails the barrier stage, and Spark does not retry a failed barrier
  result stage; the driver sees the worker's control connection drop (or the stage fail),
  cancels the stage's job group, restores the latest complete checkpoint and submits a new
  stage, under the job's :class:`abs.RestartStrategy`.
* Slots: Spark waits (by default ~10 minutes) when a barrier stage needs more slots than the
  cluster has. :class:`SparkExecutor` checks first and fails at once, naming the numbers.
* Addresses: on a ``local[N]`` master everything binds to 127.0.0.1. On a cluster the driver
  listens on ``spark.driver.host`` and workers bind to all interfaces and publish the host
  name Spark knows their executor by; storage must be a URL every executor can reach
  (e.g. S3), which :class:`SparkExecutor` checks (``memory://`` is refused).
"""
from __future__ import annotations

import logging
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import Any, Callable, Iterator

from storage.extras import require

from ..errors import ConfigError
from .writer import die_with_parent

log = logging.getLogger(__name__)

__all__ = ["SparkExecutor", "free_task_slots"]

_SLOT_WAIT_S = 20.0  # how long a (re)launch waits for busy slots to free up
_FAIL_RE = re.compile(r"abs worker (\d+) (?:exited with code|was killed by signal) (-?\d+)")


def _master_slots(master: str) -> int | None:
    """Task slots of a local master (``local``, ``local[N]``, ``local[*]``, ``local[N,F]``)."""
    if master == "local":
        return 1
    m = re.fullmatch(r"local\[(\*|\d+)(?:,\d+)?\]", master)
    if m is None:
        return None
    return (os.cpu_count() or 1) if m.group(1) == "*" else int(m.group(1))


def free_task_slots(sc: Any) -> tuple[int, int]:
    """``(total, free)`` task slots of the cluster behind SparkContext ``sc``: cores divided by
    ``spark.task.cpus``, minus the tasks running now."""
    cpus_per_task = int(sc.getConf().get("spark.task.cpus", "1"))
    total = _master_slots(sc.master)
    if total is None:
        total = sc.defaultParallelism  # cluster managers: the executors' total cores
    total //= max(1, cpus_per_task)
    running = 0
    try:
        for info in sc._jsc.sc().statusTracker().getExecutorInfos():
            running += int(info.numRunningTasks())
    except Exception:  # noqa: BLE001 - a best-effort figure: not every deployment exposes it
        running = 0
    return total, max(0, total - running)


def _task_body(boots: list[dict], remote_hosts: bool) -> Callable[[Iterator[int]], Iterator[tuple[int, int]]]:
    """The function each barrier task runs: start worker ``partitionId`` and wait for it."""

    def run(_rows: Iterator[int]) -> Iterator[tuple[int, int]]:
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        part = ctx.partitionId()
        boot = dict(boots[part])
        index = boot["index"]  # the worker's index in the job (a joining worker's stage has one task)
        if remote_hosts:
            boot["bind_host"] = "0.0.0.0"
            boot["advertise_host"] = ctx.getTaskInfos()[part].address.rsplit(":", 1)[0]
        env = dict(os.environ)
        paths = boot.pop("pythonpath", None) or [p for p in sys.path if p]
        env["PYTHONPATH"] = os.pathsep.join(paths)
        proc = subprocess.Popen(
            [sys.executable, "-c", "from abs.runtime.worker_main import main; main()"],
            stdin=subprocess.PIPE, env=env, close_fds=True, preexec_fn=die_with_parent,
        )
        assert proc.stdin is not None
        proc.stdin.write((json.dumps(boot) + "\n").encode())
        proc.stdin.close()
        code = proc.wait()
        if code < 0:
            raise RuntimeError(f"abs worker {index} was killed by signal {-code}")
        if code != 0:
            raise RuntimeError(f"abs worker {index} exited with code {code}")
        yield index, code

    return run


class _StageRun:
    """One barrier stage running the workers of one attempt, in a thread of the driver."""

    def __init__(self, spark: Any, boots: list[dict], remote_hosts: bool, description: str) -> None:
        self.sc = spark.sparkContext
        self.group = f"abs-{uuid.uuid4().hex[:12]}"
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.failed_index: int | None = None
        self.failed_code: int | None = None
        self._body = _task_body(boots, remote_hosts)
        self._n = len(boots)
        self._description = description
        self.thread = threading.Thread(target=self._run, name=self.group, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.sc.setJobGroup(self.group, self._description, interruptOnCancel=True)
            rdd = self.sc.parallelize(range(self._n), self._n)
            rdd.barrier().mapPartitions(self._body).collect()
        except BaseException as exc:  # noqa: BLE001 - reported through poll()
            self.error = exc
            m = _FAIL_RE.search(str(exc))
            if m:
                self.failed_index, self.failed_code = int(m.group(1)), int(m.group(2))
        finally:
            self.done.set()

    def cancel(self) -> None:
        if not self.done.is_set():
            try:
                self.sc.cancelJobGroup(self.group)
            except Exception:  # noqa: BLE001 - the context may be stopping
                pass


class _SparkWorker:
    """What the driver holds for worker ``index``: the subset of ``subprocess.Popen`` it uses."""

    def __init__(self, stage: _StageRun, index: int, local: bool) -> None:
        self.stage = stage
        self.index = index
        self.local = local
        self.pid: int | None = None  # the worker child's pid, from its hello
        self.returncode: int | None = None

    def bind_pid(self, pid: int | None) -> None:
        self.pid = pid

    def poll(self) -> int | None:
        st = self.stage
        if not st.done.is_set():
            return None
        if st.error is None:
            self.returncode = 0
        elif st.failed_index is None:
            self.returncode = 1  # the stage failed without naming a worker (e.g. canceled)
        elif st.failed_index == self.index:
            code = st.failed_code or 1
            self.returncode = -code if "signal" in str(st.error) else code
        else:
            return None  # stopped because another worker failed: that one is reported
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        if not self.stage.done.wait(60.0 if timeout is None else timeout):
            if timeout is None:
                log.warning(f"Spark stage {self.stage.group} did not end within 60 s after cancel")
                return None
            raise subprocess.TimeoutExpired(f"spark task {self.index}", timeout)
        return self.poll()

    def kill(self) -> None:
        if self.local and self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
                return
            except ProcessLookupError:
                pass
        self.stage.cancel()


class SparkExecutor:
    """Runs a job's ``num_workers`` workers as the tasks of one Spark barrier stage.

    ``spark``: an active ``SparkSession``. ``num_workers``: the job's parallelism (``abs.run``
    uses it when ``parallelism`` is not given; both must agree when both are). ``driver_host``:
    the address workers reach the driver at (default: 127.0.0.1 on a ``local`` master, else
    ``spark.driver.host``).
    """

    def __init__(self, spark: Any, num_workers: int | None = None, *, driver_host: str | None = None) -> None:
        require("spark", "abs.SparkExecutor")
        if spark is None:
            raise ConfigError(
                "SparkExecutor needs an active SparkSession: pass SparkSession.builder...getOrCreate() "
                "(or use executor='local')"
            )
        if not hasattr(spark, "sparkContext"):
            raise ConfigError(f"SparkExecutor needs a pyspark.sql.SparkSession, got {type(spark).__name__}")
        if num_workers is not None and (not isinstance(num_workers, int) or isinstance(num_workers, bool)
                                        or num_workers < 1):
            raise ConfigError(f"SparkExecutor: num_workers must be a positive integer, got {num_workers!r}")
        self.spark = spark
        self.num_workers = num_workers
        self._driver_host = driver_host
        self._stage: _StageRun | None = None

    # -- what JobDriver asks of an executor ---------------------------------------------------
    @property
    def sc(self) -> Any:
        sc = self.spark.sparkContext
        if getattr(sc, "_jsc", None) is None:
            raise ConfigError("SparkExecutor: the SparkSession has been stopped; create a new one")
        return sc

    @property
    def local_master(self) -> bool:
        return self.sc.master.startswith("local")

    def driver_host(self) -> str:
        if self._driver_host:
            return self._driver_host
        if self.local_master:
            return "127.0.0.1"
        return self.sc.getConf().get("spark.driver.host", "127.0.0.1")

    def check(self, parallelism: int, storage_url: str | None) -> None:
        """Refuse what cannot work before anything is submitted."""
        if self.num_workers is not None and self.num_workers != parallelism:
            raise ConfigError(
                f"SparkExecutor(num_workers={self.num_workers}) but parallelism={parallelism}; pass one of them, "
                "or the same number to both"
            )
        total, free = free_task_slots(self.sc)
        if parallelism > free:
            raise ConfigError(
                f"SparkExecutor: the job needs {parallelism} task slots at once (one barrier stage of {parallelism} "
                f"tasks), but the Spark cluster ({self.sc.master}) has {total} slot(s), {free} free; lower the "
                "parallelism, free slots, or give Spark more cores/executors (e.g. master local[N] with "
                f"N >= {parallelism}); Spark itself would wait for minutes before failing"
            )
        if storage_url is not None and storage_url.startswith("memory://"):
            raise ConfigError(
                f"SparkExecutor: storage {storage_url!r} is process-local memory that Spark's workers cannot "
                "reach; use a path on a shared file system or an object store URL such as s3://bucket/prefix"
            )

    def launch_all(self, boots: list[dict], job_name: str) -> list[_SparkWorker]:
        """Submit the barrier stage; one handle per worker."""
        # after a failure, the tasks of the previous stage may take a moment to be reaped:
        # wait for their slots a little before refusing
        deadline = time.monotonic() + _SLOT_WAIT_S
        while free_task_slots(self.sc)[1] < len(boots) and time.monotonic() < deadline:
            time.sleep(0.2)
        self.check(len(boots), None)
        if self.local_master:
            # the same machine: workers import user code the way the driver does (on a
            # cluster, ship it with --py-files / SparkContext.addPyFile like any PySpark code)
            path = [p for p in sys.path if p]
            boots = [dict(b, pythonpath=path) for b in boots]
        stage = _StageRun(self.spark, boots, remote_hosts=not self.local_master,
                          description=f"abs job {job_name!r}: {len(boots)} workers")
        self._stage = stage
        return [_SparkWorker(stage, i, self.local_master) for i in range(len(boots))]

    def check_launch(self, count: int) -> str | None:
        """Why ``count`` more workers cannot start now (a rescale), or None."""
        total, free = free_task_slots(self.sc)
        if count > free:
            return (f"the Spark cluster ({self.sc.master}) has {free} free task slot(s) of {total}, and {count} more "
                    "worker(s) need one each; give Spark more cores/executors or rescale to fewer workers")
        return None

    def launch(self, index: int, boot: dict) -> _SparkWorker:
        """A worker that joins a running job (a rescale): a Spark job of its own with one
        barrier task, beside the stage of the workers the job started with (a barrier stage's
        size is fixed once submitted)."""
        if self.local_master:
            boot = dict(boot, pythonpath=[p for p in sys.path if p])
        stage = _StageRun(self.spark, [dict(boot, index=index)], remote_hosts=not self.local_master,
                          description=f"abs worker {index} joining a running job")
        return _SparkWorker(stage, index, self.local_master)

    def __repr__(self) -> str:
        return f"SparkExecutor(master={self.spark.sparkContext.master!r}, num_workers={self.num_workers})"
