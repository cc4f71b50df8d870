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
  cluster has. :class:`SparkExecutor` checks first and fails naming the numbers: on a local
  master at once; on a cluster it counts the slots of the executors registered now (Spark's
  ``defaultParallelism`` is at least 2 however few there are), and waits up to ``slot_wait``
  seconds for executors that are still registering or being started again after one was
  lost (when ``spark.cores.max`` or a fixed number of executors caps the application below
  the need, only until the capped slots are there).
* Addresses: on a ``local[N]`` master everything binds to 127.0.0.1. On a cluster the driver
  listens on ``spark.driver.bindAddress`` (else ``spark.driver.host``) and workers connect to
  ``spark.driver.host``: the address Spark's own executors reach the driver at (both
  overridable: ``driver_host=``, ``driver_bind_host=``); a loopback driver address with a
  master elsewhere is refused with the setting to change. Workers bind to all interfaces and
  publish the host name Spark knows their executor by; storage must be a URL every executor
  can reach (e.g. S3), which :class:`SparkExecutor` checks (``memory://`` is refused).
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

__all__ = ["SparkExecutor", "driver_address_problem", "free_task_slots"]

_SLOT_WAIT_S = 20.0  # how long a (re)launch waits for busy slots to free up
_OWN_TASKS_WAIT_S = 60.0  # how long a (re)launch waits for the tasks of its own failed stage to end
_FAIL_RE = re.compile(r"abs worker (\d+) (?:exited with code|was killed by signal) (-?\d+)")
# a barrier task that failed before its abs worker ended (its Spark Python worker killed or
# crashed: the worker dies with it): Spark names the task's partition and its own reason
_TASK_FAIL_RE = re.compile(r"barrier task ResultTask\(\d+, (\d+)\) finished unsuccessfully\.\s*\n"
                           r"(?:[\w.$]+(?:Exception|Error): )?([^\n]*)")


def _master_slots(master: str) -> int | None:
    """Task slots of a local master (``local``, ``local[N]``, ``local[*]``, ``local[N,F]``)."""
    if master == "local":
        return 1
    m = re.fullmatch(r"local\[(\*|\d+)(?:,\d+)?\]", master)
    if m is None:
        return None
    return (os.cpu_count() or 1) if m.group(1) == "*" else int(m.group(1))


def free_task_slots(sc: Any) -> tuple[int, int]:
    """``(total, free)`` task slots of the cluster behind SparkContext ``sc``: on a local master
    its cores, on a cluster the slots of the executors registered now (what Spark's own barrier
    check counts), divided by ``spark.task.cpus``; minus the tasks running now."""
    cpus_per_task = int(sc.getConf().get("spark.task.cpus", "1"))
    total = _master_slots(sc.master)
    if total is not None:
        total //= max(1, cpus_per_task)
    else:
        total = _registered_slots(sc)
    running = 0
    try:
        for info in sc._jsc.sc().statusTracker().getExecutorInfos():
            running += int(info.numRunningTasks())
    except Exception:  # noqa: BLE001 - a best-effort figure: not every deployment exposes it
        running = 0
    return total, max(0, total - running)


def _active_tasks(sc: Any, group: str) -> int:
    """Tasks still running in the Spark jobs of job group ``group`` (0 when Spark no longer
    knows the group)."""
    tracker = sc.statusTracker()
    active = 0
    for job in tracker.getJobIdsForGroup(group):
        info = tracker.getJobInfo(job)
        for stage in (info.stageIds if info is not None else ()):
            stage_info = tracker.getStageInfo(stage)
            if stage_info is not None:
                active += int(stage_info.numActiveTasks)
    return active


def _registered_slots(sc: Any) -> int:
    """Task slots of the executors registered now. ``defaultParallelism`` is no measure on a
    cluster: it is at least 2 however few executors there are (or ``spark.default.parallelism``)."""
    jsc = sc._jsc.sc()
    try:
        return int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()))
    except Exception:  # noqa: BLE001 - an internal API of Spark 3.1+; fall back to executor count x cores
        executors = max(0, len(jsc.statusTracker().getExecutorInfos()) - 1)  # minus the driver
        cores = int(sc.getConf().get("spark.executor.cores", "1"))
        return executors * cores // max(1, int(sc.getConf().get("spark.task.cpus", "1")))


def _max_slots(sc: Any) -> int | None:
    """The most slots this application may ever get, when its configuration caps it
    (``spark.cores.max`` on standalone and Mesos; ``spark.executor.instances`` x cores with
    dynamic allocation off); ``None`` when nothing says."""
    conf = sc.getConf()
    cpus_per_task = max(1, int(conf.get("spark.task.cpus", "1")))
    if conf.get("spark.cores.max", None):
        return int(conf.get("spark.cores.max")) // cpus_per_task
    if conf.get("spark.executor.instances", None) and conf.get("spark.executor.cores", None) \
            and conf.get("spark.dynamicAllocation.enabled", "false").lower() != "true":
        return int(conf.get("spark.executor.instances")) * int(conf.get("spark.executor.cores")) // cpus_per_task
    return None


def _host_of(master: str) -> str | None:
    """The host of a ``spark://host:port`` master (the first of a list), else ``None``."""
    m = re.match(r"spark://\[?([^\]:/,]+)", master)
    return m.group(1) if m else None


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def driver_address_problem(master: str, driver_host: str) -> str | None:
    """Why workers of a cluster behind ``master`` could not reach a driver listening on
    ``driver_host``, or ``None``: a loopback driver address is only reachable when the master
    (and so, on standalone, its workers) is on loopback too."""
    if master.startswith("local"):
        return None
    master_host = _host_of(master)
    if _is_loopback(driver_host) and (master_host is None or not _is_loopback(master_host)):
        return (f"the driver's address is {driver_host!r} (loopback), which executors on other hosts cannot "
                f"reach (master {master}); set spark.driver.host to an address of this machine that the "
                "executors reach (e.g. the bridge or LAN address), or pass SparkExecutor(..., driver_host=...)")
    return None


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


def _stage_failure(text: str, indexes: list[int]) -> tuple[int | None, int | None, str | None]:
    """``(worker index, exit code, reason)`` of the failure of a stage whose tasks ran the
    workers ``indexes`` (by partition), from the text of Spark's error: a worker's exit status
    (code set), else the task Spark names as failed and Spark's reason (e.g. its Python worker
    was killed: the abs worker died with it); ``(None, None, None)`` when neither is there."""
    m = _FAIL_RE.search(text)
    if m:
        return int(m.group(1)), int(m.group(2)), None
    task = _TASK_FAIL_RE.search(text)
    if task and int(task.group(1)) < len(indexes):
        reason = task.group(2).split(". Consider setting")[0].strip() or "no reason given"
        return indexes[int(task.group(1))], None, reason
    return None, None, None


class _StageRun:
    """One barrier stage running the workers of one attempt, in a thread of the driver."""

    def __init__(self, spark: Any, boots: list[dict], remote_hosts: bool, description: str) -> None:
        self.sc = spark.sparkContext
        self.group = f"abs-{uuid.uuid4().hex[:12]}"
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.failed_index: int | None = None
        self.failed_code: int | None = None
        self.failed_reason: str | None = None  # Spark's reason, when the task failed without a worker exit status
        self._indexes = [b["index"] for b in boots]
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
            self.failed_index, self.failed_code, self.failed_reason = _stage_failure(str(exc), self._indexes)
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
        self.exit_detail: str | None = None  # how it ended, when not by its own exit status

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
            lines = [line.strip() for line in str(st.error).splitlines() if line.strip()]
            self.exit_detail = (f"ended with its Spark stage, which failed ({type(st.error).__name__}"
                                f"{': ' + lines[0][:300] if lines else ''})")
        elif st.failed_index == self.index:
            if st.failed_code is None:  # its Spark task failed first (its Python worker killed, say)
                self.returncode = 1
                self.exit_detail = f"ended with its Spark task, which failed: {st.failed_reason}"
            else:
                code = st.failed_code
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
    uses it when ``parallelism`` is not given; both must agree when both are).

    ``driver_host``: the address workers reach the driver at (default: 127.0.0.1 on a
    ``local`` master, else ``spark.driver.host``: the address Spark's executors already reach
    the driver at). ``driver_bind_host``: the address the driver listens on, when it differs
    from the one workers reach (behind NAT, in a container: default
    ``spark.driver.bindAddress``, else ``driver_host``). The driver's port is chosen freely.

    ``slot_wait``: on a cluster, how many seconds a (re)launch waits for enough free task
    slots (executors still registering, or started again after one was lost) before it fails
    naming the free and needed slots (when the application's configuration caps it below the
    need: ``spark.cores.max``, or ``spark.executor.instances`` x ``spark.executor.cores``, only
    until the capped slots are there).
    """

    def __init__(self, spark: Any, num_workers: int | None = None, *, driver_host: str | None = None,
                 driver_bind_host: str | None = None, slot_wait: float = _SLOT_WAIT_S) -> None:
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
        if isinstance(slot_wait, bool) or not isinstance(slot_wait, (int, float)) or not 0 <= slot_wait < float("inf"):
            raise ConfigError(f"SparkExecutor: slot_wait must be a number of seconds >= 0, got {slot_wait!r}")
        self.spark = spark
        self.num_workers = num_workers
        self._driver_host = driver_host
        self._driver_bind_host = driver_bind_host
        self.slot_wait = float(slot_wait)
        self._runs: list[_StageRun] = []  # every stage this executor submitted whose tasks may still run

    # -- what JobDriver asks of an executor ---------------------------------------------------
    @property
    def sc(self) -> Any:
        sc = self.spark.sparkContext
        if getattr(sc, "_jsc", None) is None:
            raise ConfigError("SparkExecutor: the SparkSession has been stopped; create a new one")
        try:
            stopped = bool(sc._jsc.sc().isStopped())
        except Exception as exc:  # noqa: BLE001 - py4j: the JVM behind the session does not answer
            raise ConfigError(
                f"SparkExecutor: the Spark driver JVM of this SparkSession is gone ({type(exc).__name__}: {exc}; it was "
                "killed, crashed or ran out of memory), so no Spark stage can run on this session; start a new "
                "SparkSession (a new Python process is the sure way: getOrCreate() may return the dead one) and run "
                "the job again with restore='latest' to continue from its latest complete checkpoint"
            ) from exc
        if stopped:
            raise ConfigError("SparkExecutor: the SparkContext of this SparkSession has been stopped (by Spark after "
                              "an error, or by spark.stop()); create a new SparkSession and run the job again with "
                              "restore='latest'")
        return sc

    @property
    def local_master(self) -> bool:
        return self.sc.master.startswith("local")

    def driver_host(self) -> str:
        """The address the workers connect to the driver at."""
        if self._driver_host:
            return self._driver_host
        if self.local_master:
            return "127.0.0.1"
        return self.sc.getConf().get("spark.driver.host", "127.0.0.1")

    def driver_bind_host(self) -> str:
        """The address the driver listens on for its workers."""
        if self._driver_bind_host:
            return self._driver_bind_host
        if self.local_master or self._driver_host:
            return self.driver_host()
        return self.sc.getConf().get("spark.driver.bindAddress", None) or self.driver_host()

    def _wait_for_own_tasks(self, seconds: float = _OWN_TASKS_WAIT_S) -> None:
        """Wait until the tasks of this executor's ended stages have ended too. A failed barrier
        stage ends for the driver before Spark has killed and reaped its other tasks (seconds on
        a loaded machine); their slots are the job's own, not missing capacity, and a restart
        that counted them as taken would start with fewer workers than it can have."""
        start = time.monotonic()
        deadline = start + seconds
        while True:
            self._runs = [r for r in self._runs if not r.done.is_set() or _active_tasks(self.sc, r.group) > 0]
            lingering = [r.group for r in self._runs if r.done.is_set()]
            if not lingering:
                if time.monotonic() - start > 0.05:
                    log.info(f"[abs] waited {time.monotonic() - start:.1f} s for the tasks of an ended stage to end")
                return
            if time.monotonic() >= deadline:
                log.warning(f"tasks of the ended Spark job group(s) {', '.join(lingering)} still run after "
                            f"{seconds:.0f} s; counting their slots as taken")
                return
            time.sleep(0.1)

    def _wait_for_slots(self, needed: int, seconds: float) -> tuple[int, int]:
        """Wait up to ``seconds`` for ``needed`` free slots; returns ``(total, free)`` then."""
        deadline = time.monotonic() + seconds
        total, free = free_task_slots(self.sc)
        while free < needed and time.monotonic() < deadline:
            time.sleep(0.2)
            total, free = free_task_slots(self.sc)
        return total, free

    def check(self, parallelism: int, storage_url: str | None, *, wait: bool = True,
              queries: list[tuple[str, Any]] = ()) -> None:
        """Refuse what cannot work before anything is submitted. On a cluster, wait up to
        ``slot_wait`` s for executors to register. ``queries``: ``(uid, source)`` of the job's
        sources that run a Spark query of their own (``SparkMicroBatchSource``) in this
        application: its tasks need slots the barrier stage leaves free."""
        if self.num_workers is not None and self.num_workers != parallelism:
            raise ConfigError(
                f"SparkExecutor(num_workers={self.num_workers}) but parallelism={parallelism}; pass one of them, "
                "or the same number to both"
            )
        if storage_url is not None and storage_url.startswith("memory://"):
            raise ConfigError(
                f"SparkExecutor: storage {storage_url!r} is process-local memory that Spark's workers cannot "
                "reach; use a path on a shared file system or an object store URL such as s3://bucket/prefix"
            )
        problem = None if self._driver_host else driver_address_problem(self.sc.master, self.driver_host())
        if problem is not None:
            raise ConfigError(f"SparkExecutor: {problem}")
        self._check_slots(parallelism, wait)
        self._check_query_slots(parallelism, queries)

    def _check_query_slots(self, parallelism: int, queries: list[tuple[str, Any]]) -> None:
        """Refuse a barrier stage that takes every slot the application can have while a source's
        Spark query needs one too: its micro-batches would wait for a slot for ever, and the job
        would run without reading a row (on a cluster whose slots nothing caps, more executors
        may come: not refused)."""
        if not queries:
            return
        needed = max(int(getattr(src, "spark_query_slots", 1)) for _, src in queries)
        total, _ = free_task_slots(self.sc)
        cap = total if self.local_master else _max_slots(self.sc)
        if cap is None or parallelism + needed <= cap:
            return
        names = ", ".join(f"{uid!r} ({type(src).__name__})" for uid, src in queries)
        hint = (f"master local[N] with N >= {parallelism + needed}" if self.local_master
                else f"spark.cores.max >= {parallelism + needed}")
        raise ConfigError(
            f"SparkExecutor: the job's {parallelism} workers take all {cap} task slot(s) of the Spark application "
            f"({self.sc.master}), but source {names} runs a Spark streaming query in the same application whose "
            f"tasks need {needed} slot(s) beside them: no micro-batch would ever be staged and the job would read "
            f"nothing; use at most {cap - needed} workers, or give Spark more cores ({hint})"
        )

    def _check_slots(self, parallelism: int, wait: bool) -> None:
        """Refuse a stage of ``parallelism`` tasks the cluster has no free slots for, naming
        the numbers (on a cluster, after waiting ``slot_wait`` s when ``wait``)."""
        total, free = free_task_slots(self.sc)
        cap = None if self.local_master else _max_slots(self.sc)
        if parallelism > free and wait and not self.local_master:
            # executors may still be registering: wait for the slots, or (capped below the
            # need) only for those the application can get, to name real numbers
            total, free = self._wait_for_slots(parallelism if cap is None else min(cap, parallelism), self.slot_wait)
        if parallelism > free:
            if self.local_master:
                hint = f"e.g. master local[N] with N >= {parallelism}"
                waited = "Spark itself would wait for minutes before failing"
            else:
                hint = "more workers or cores, or spark.cores.max >= " + str(parallelism)
                waited = (f"the application may use at most {cap} slot(s) (spark.cores.max / executor settings)"
                          if cap is not None and cap < parallelism else
                          f"waited {self.slot_wait:.0f} s for executors to register; Spark itself would wait "
                          "for minutes before failing")
            raise ConfigError(
                f"SparkExecutor: the job needs {parallelism} task slots at once (one barrier stage of {parallelism} "
                f"tasks), but the Spark cluster ({self.sc.master}) has {total} slot(s), {free} free; lower the "
                f"parallelism, free slots, or give Spark more cores/executors ({hint}); {waited}"
            )

    def available_workers(self, wanted: int) -> tuple[int, str]:
        """How many of ``wanted`` workers can start now (a restart that may go on with fewer:
        ``RestartStrategy.min_workers``), once the tasks of the job's ended stages have ended, and
        after waiting up to ``slot_wait`` s more for all of them; and a description of the slots
        for the log."""
        self._wait_for_own_tasks()
        total, free = self._wait_for_slots(wanted, self.slot_wait)
        return min(free, wanted), f"the Spark cluster ({self.sc.master}) has {free} free task slot(s) of {total}"

    def launch_all(self, boots: list[dict], job_name: str) -> list[_SparkWorker]:
        """Submit the barrier stage; one handle per worker."""
        # after a failure, the tasks of the previous stage may take a moment to be reaped (and
        # on a cluster, a lost executor to be started again): wait for slots before refusing
        self._wait_for_own_tasks()
        self._wait_for_slots(len(boots), self.slot_wait)
        self._check_slots(len(boots), wait=False)  # a restart may run fewer (RestartStrategy.min_workers)
        if self.local_master:
            # the same machine: workers import user code the way the driver does (on a
            # cluster, ship it with --py-files / SparkContext.addPyFile like any PySpark code)
            path = [p for p in sys.path if p]
            boots = [dict(b, pythonpath=path) for b in boots]
        stage = _StageRun(self.spark, boots, remote_hosts=not self.local_master,
                          description=f"abs job {job_name!r}: {len(boots)} workers")
        self._runs.append(stage)
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
        self._runs.append(stage)
        return _SparkWorker(stage, index, self.local_master)

    def __repr__(self) -> str:
        return f"SparkExecutor(master={self.spark.sparkContext.master!r}, num_workers={self.num_workers})"
