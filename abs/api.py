"""Running a dataflow: :func:`run` blocks, :func:`submit` returns a :class:`JobHandle`."""
from __future__ import annotations

import inspect
import math
import queue
import threading
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Callable, TypeVar

from .autoscale import Autoscale
from .config import CheckpointConfig, RestartStrategy
from .dataflow import Dataflow
from .errors import ConfigError, JobFailedError
from .options import Restore, RestoreValue, RuntimeOptions
from .runtime.driver import JobDriver, JobResult, LocalExecutor

__all__ = ["run", "submit", "JobHandle"]

_R = TypeVar("_R")


@dataclass(frozen=True)
class _JobOptions:
    """The keyword arguments :func:`run` and :func:`submit` take (the one list of them: their
    signatures are made from it), normalised by :func:`_job_options`."""

    parallelism: int | None = None
    checkpoint: CheckpointConfig | None = None
    storage: str | None = None
    storage_options: dict | None = None
    restore: RestoreValue = None
    executor: Any = "local"
    restart: RestartStrategy | None = None
    allow_non_restored_state: bool = False
    allow_repeated_output: bool = False
    runtime: RuntimeOptions | None = None
    dashboard: Any = None  # True, "HOST:PORT" or an abs.observe.Dashboard: serve the job's page (abs.observe)
    autoscale: Any = None  # an abs.Autoscale: scale the running job by its load (abs.autoscale)


# keywords that moved into RuntimeOptions; still taken by run/submit for one release
_MOVED_TO_RUNTIME = ("faults", "heartbeat_timeout")


def _job_options(caller: str, options: dict[str, Any]) -> _JobOptions:
    """``run``'s or ``submit``'s keyword arguments as one :class:`_JobOptions`: unknown names
    refused as Python refuses them, the keywords moved into :class:`RuntimeOptions` taken
    with a ``DeprecationWarning`` that names the replacement."""
    moved = {k: options.pop(k) for k in _MOVED_TO_RUNTIME if k in options}
    names = {f.name for f in fields(_JobOptions)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}")
    if moved:
        spelled = ", ".join(f"{k}=..." for k in moved)
        if options.get("runtime") is not None:
            raise ConfigError(f"abs.{caller}(): {spelled} given beside runtime=; pass them only inside "
                              f"runtime=abs.RuntimeOptions({spelled})")
        warnings.warn(f"abs.{caller}({spelled}) is deprecated and will be removed in the next release; pass "
                      f"runtime=abs.RuntimeOptions({spelled}) instead", DeprecationWarning, stacklevel=3)
        options["runtime"] = RuntimeOptions(**moved)
    return _JobOptions(**options)


def _driver(flow: Dataflow, o: _JobOptions) -> JobDriver:
    if not isinstance(flow, Dataflow):
        raise ConfigError(f"expected an abs.Dataflow, got {type(flow).__name__}")
    executor, parallelism, checkpoint = o.executor, o.parallelism, o.checkpoint
    if executor in (None, "local"):
        executor = LocalExecutor()
    elif isinstance(executor, str):
        raise ConfigError(f"executor must be 'local' or an executor object (e.g. abs.SparkExecutor), got {executor!r}")
    elif isinstance(executor, type) or not callable(getattr(executor, "launch", None)):
        # anything else failed the job once it started ("'object' object has no attribute 'launch'")
        raise ConfigError(f"executor must be 'local' or an executor object (abs.LocalExecutor(...), "
                          f"abs.SparkExecutor(spark, num_workers=...)), got {_spelled(executor)}")
    if parallelism is None:  # the executor's size (SparkExecutor(num_workers=...)), else 1
        parallelism = getattr(executor, "num_workers", None) or 1
    if checkpoint is not None and not isinstance(checkpoint, CheckpointConfig):
        raise ConfigError(f"checkpoint must be an abs.CheckpointConfig, got {type(checkpoint).__name__}")
    if o.storage is not None and checkpoint is None:
        checkpoint = CheckpointConfig()  # on-request and final checkpoints only
    runtime = RuntimeOptions() if o.runtime is None else o.runtime
    if not isinstance(runtime, RuntimeOptions):
        raise ConfigError(f"runtime must be an abs.RuntimeOptions, got {type(runtime).__name__}; "
                          "pass runtime=abs.RuntimeOptions(...)")
    storage_options = o.storage_options
    if storage_options is not None:
        # they go to fsspec as keyword arguments, in the driver and in every worker: anything but a
        # mapping would fail only there, as a failed job
        if not isinstance(storage_options, Mapping):
            raise ConfigError(f"storage_options must be a mapping (a dict of the file system's options) or None, "
                              f"got {_spelled(storage_options)}; pass e.g. storage_options={{'endpoint_url': ...}}")
        storage_options = dict(storage_options)
    if o.restart is not None and not isinstance(o.restart, RestartStrategy):
        # the driver reads its fields (min_workers, max_restarts): anything else fails deep inside it
        raise ConfigError(f"restart must be an abs.RestartStrategy instance or None, got {_spelled(o.restart)}; "
                          "pass restart=abs.RestartStrategy(max_restarts=...)")
    for name in ("allow_non_restored_state", "allow_repeated_output"):
        if not isinstance(getattr(o, name), bool):  # "no" or "false" read as true
            raise ConfigError(f"{name} must be True or False, got {_spelled(getattr(o, name))}")
    if o.autoscale is not None and not isinstance(o.autoscale, Autoscale):
        raise ConfigError(f"autoscale must be an abs.Autoscale, got {type(o.autoscale).__name__}; pass "
                          "autoscale=abs.Autoscale(min_workers=..., max_workers=...)")
    if o.autoscale is not None:
        # autoscaling carries its decisions out by live reconfiguration: where that is refused,
        # every decision would fail while the job ran on at its first parallelism
        why = ("takes unaligned checkpoints (mode='unaligned' or alignment_timeout)"
               if checkpoint is not None and checkpoint.priority_barriers
               else "has an iteration (a loop)" if flow.has_loops else None)
        if why is not None:
            raise ConfigError(f"autoscale=: job {flow.name!r} {why}, and live reconfiguration of such a job is not "
                              "supported yet, so it could never scale; drop autoscale=, or use aligned checkpoints "
                              "without alignment_timeout and no loop")
        a = o.autoscale
        if type(parallelism) is int and not a.min_workers <= parallelism <= a.max_workers:
            # the policy keeps the job within the bounds but never brings it into them: below
            # min_workers a job that is not overloaded stays there
            raise ConfigError(f"parallelism={parallelism} is outside autoscale's min_workers..max_workers "
                              f"({a.min_workers}..{a.max_workers}); start the job at a parallelism within them")
    return JobDriver(
        flow,
        parallelism=parallelism,
        checkpoint=checkpoint,
        storage=o.storage,
        storage_options=storage_options,
        restore=Restore.parse(o.restore).value,  # the runtime takes the plain value
        executor=executor,
        restart=o.restart,
        allow_non_restored_state=o.allow_non_restored_state,
        faults=runtime.faults,
        startup_timeout=runtime.startup_timeout,
        heartbeat_timeout=runtime.heartbeat_timeout,
        allow_repeated_output=o.allow_repeated_output,
        progress=runtime.progress,
        autoscale=o.autoscale,
    )


def _spelled(value: Any) -> str:
    """``value`` for an error message: a class by its name, anything else by its type and repr."""
    if isinstance(value, type):
        return f"the class {value.__module__}.{value.__qualname__} itself"
    return f"{type(value).__name__} {value!r}"


def _takes_job_options(fn: Callable[..., _R]) -> Callable[..., _R]:
    """Give ``fn(flow, **options)`` the signature ``fn(flow, *, <the fields of _JobOptions>)``
    for ``help()`` and ``inspect``."""
    params = [inspect.Parameter("flow", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="Dataflow")]
    params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
               for f in fields(_JobOptions)]
    fn.__signature__ = inspect.Signature(params, return_annotation=fn.__annotations__.get("return"))  # type: ignore[attr-defined]
    return fn


@_takes_job_options
def run(flow: Dataflow, **options: Any) -> JobResult:
    """Run ``flow`` on ``parallelism`` workers until its bounded sources are exhausted.

    ``parallelism``: number of workers (default: ``executor.num_workers`` if the executor
    has one, else 1). ``executor``: ``"local"`` (worker processes on this machine) or
    ``abs.SparkExecutor(spark, num_workers=P)`` (the tasks of one Spark barrier stage).

    ``checkpoint``: when and how to checkpoint (needs ``storage``). ``storage``: a path or
    fsspec URL (``file://``, ``memory://``, ``s3://bucket/prefix`` with ``storage_options``).
    ``restore``: an :class:`abs.Restore` (``Restore.latest()``, ``.checkpoint(id)``, ...) or
    the plain value it stands for: ``None`` (a fresh start; refused when ``storage`` already holds checkpoints of
    this job), ``"latest"`` (the newest checkpoint that can be restored, walking back past broken
    ones; refused when there is none), ``"latest-if-any"`` (the same, or a fresh start when the
    root holds no checkpoint), ``"fresh"`` (empty state on purpose; new checkpoint ids continue
    above the existing ones), a checkpoint id, or a savepoint path. Restoring a checkpoint older
    than output the sinks already committed rolls that output back first (sinks with
    ``supports_rollback``, e.g. ``FileSink``); for a sink that cannot, the restore refuses with
    :class:`abs.RepeatedOutputError` unless ``allow_repeated_output=True`` (then it warns and
    the output is published again). ``JobResult.skipped_checkpoints``, ``rolled_back`` and
    ``repeated_output`` say what happened.
    ``allow_non_restored_state``: restore even if the snapshot holds state of operators the
    job no longer has (that state is dropped). ``restart``: an :class:`abs.RestartStrategy`
    (default: no restart). ``runtime``: an :class:`abs.RuntimeOptions` (heartbeat and startup
    timeouts of worker supervision, failure injection for tests); the keywords ``faults`` and
    ``heartbeat_timeout`` of earlier releases still work, with a ``DeprecationWarning``.
    ``dashboard``: serve a live page of the job while it runs (``True``: on loopback, a free
    port; ``"HOST:PORT"``; or an :class:`abs.observe.Dashboard`); its URL, with the token every
    request needs, is logged when the job starts (see :mod:`abs.observe`).
    Returns a :class:`JobResult`; raises :class:`abs.JobFailedError` (with ``.result``) if
    the job fails.
    """
    o = _job_options("run", options)
    if o.dashboard not in (None, False):  # the page's buttons go through a JobHandle
        handle = JobHandle(_driver(flow, o), dashboard=o.dashboard)
        try:
            return handle.wait()
        except KeyboardInterrupt:  # as run() without a dashboard: the job stops with the caller
            handle._driver.requests.put(_cancel_request())
            raise
    return _driver(flow, o).run()


class JobHandle:
    """A running job (see :func:`submit`)."""

    def __init__(self, driver: JobDriver, dashboard: Any = None) -> None:
        self._driver = driver
        self._thread = threading.Thread(target=self._run, name=f"job-{driver.flow.name}", daemon=True)
        self._exc: BaseException | None = None
        self.dashboard = None  # the job's abs.observe.DashboardServer while it runs (its .url), if asked for
        if dashboard not in (None, False):
            from .observe import Dashboard, start_dashboard

            self.dashboard = start_dashboard(driver, Dashboard.parse(dashboard),
                                             checkpoint=self.trigger_checkpoint, savepoint=self.savepoint)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._driver.run()
        except BaseException as exc:  # noqa: BLE001 - re-raised by wait()
            self._exc = exc
        finally:
            if self.dashboard is not None:
                self.dashboard.stop()

    @property
    def status(self) -> str:
        return self._driver.status

    def trigger_checkpoint(self, timeout: float = 120.0) -> int:
        """Trigger a checkpoint now; returns its id once it is complete."""
        return self._request_checkpoint(timeout)

    def savepoint(self, path: str | None = None, timeout: float = 300.0, storage_options: dict | None = None) -> str:
        """Take a checkpoint and write it as a self-contained savepoint at ``path`` (default:
        ``<storage>/savepoints/sp-<id>``); returns the savepoint's location.

        The checkpoint is pinned against the job's garbage collection from before it is
        taken until the copy ends (a pin on every id from the next one, narrowed to the
        checkpoint once it is known; see ``storage/pins.py``). A copy that fails leaves no
        savepoint at ``path``. Sources with replay data of their own outside the snapshot (the
        Spark sources' batch log) copy what the savepoint needs of it into ``path`` too
        (``Source.driver_savepoint``), so it restores after the job's log is gone."""
        from storage import SnapshotStore

        d = self._driver
        if path is not None and (not isinstance(path, str) or not path.strip()):
            raise ConfigError(f"savepoint(path={path!r}): the path must be a non-empty str (a directory path or "
                              "fsspec URL), or None for <storage>/savepoints/sp-<id>")
        _check_timeout(timeout, "savepoint")
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise ConfigError(f"savepoint(storage_options=...): must be a mapping (a dict of the file system's options) "
                              f"or None, got {_spelled(storage_options)}; pass e.g. storage_options={{'endpoint_url': ...}}")
        if d.storage_url is None:
            raise ConfigError(f"job {d.flow.name!r} runs without storage; pass storage=... to take savepoints")
        store = d.store or SnapshotStore.open(d.storage_url, d.storage_options)
        if path is not None:
            from storage.store import _comparable

            if _comparable(path) == _comparable(store.url):
                # the savepoint would take the next checkpoint id of the root, the one the running
                # job's own next checkpoint takes: that checkpoint's commit then fails
                raise ConfigError(
                    f"savepoint(path={path!r}): that is the storage root of the running job {d.flow.name!r}; a "
                    "savepoint there takes the id of the job's next checkpoint, which then cannot commit; pass "
                    "another directory, or None for <storage>/savepoints/sp-<id> (to copy a checkpoint into its "
                    "own root, stop the job first: abs-snapshot savepoint ROOT ID ROOT)")
        sources = d._sources()
        releases = []
        try:
            # the sources' replay data (e.g. a Spark source's batch log) stays while the
            # savepoint copies what it needs of it
            for _uid, source in sources:
                releases.append(source.driver_hold())
            with store.pin(d._last_completed_id + 1, None, ttl=max(600.0, 2 * timeout),
                           holder=f"savepoint of job {d.flow.name!r}") as lease:
                cid = self._request_checkpoint(timeout)
                lease.retarget(cid, cid)
                dest = path or f"{d.storage_url.rstrip('/')}/savepoints/sp-{cid:08d}"
                offsets = store.read_manifest(cid).source_offsets
                for uid, source in sources:
                    source.driver_savepoint(dict(offsets.get(uid, {})), dest, storage_options)
                store.savepoint(cid, dest, storage_options, source_pin=lease)
        finally:
            for release in releases:
                release()
        return dest

    def _request_checkpoint(self, timeout: float) -> int:
        from .runtime.messages import CheckpointRequest

        return self._ask(CheckpointRequest(queue.Queue()), timeout, "checkpoint")

    def _ask(self, request: Any, timeout: float, what: str,
             not_running: Callable[[str], BaseException] | None = None) -> Any:
        """Put ``request`` to the driver and wait for what it puts on ``request.reply``.
        ``not_running(why)``: the error raised when the job does not run, or ends before it got
        to the request (default: :class:`JobFailedError` of ``why``)."""
        _check_timeout(timeout, what)
        gone = not_running or JobFailedError
        if not self._thread.is_alive():
            raise gone(f"job {self._driver.flow.name!r} is not running ({self.status})")
        reply = request.reply
        self._driver.requests.put(request)
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = reply.get(timeout=0.1)
                break
            except queue.Empty:
                pass
            if not self._thread.is_alive():  # the job ended before it got to the request
                try:
                    value = reply.get_nowait()
                    break
                except queue.Empty:
                    raise gone(
                        f"job {self._driver.flow.name!r} ended ({self.status}) before the requested {what} "
                        "was done" + ("" if not_running else
                                      "; request checkpoints, savepoints and reconfigurations while the job runs")
                    ) from None
            if time.monotonic() > deadline:
                raise JobFailedError(f"{what} did not complete within {timeout:.0f} s") from None
        if isinstance(value, BaseException):
            raise value
        return value

    # ------------------------------------------------------------------ live reconfiguration
    def move(self, key_groups: Any, to: int, *, strategy: str = "all_at_once", batch: int | None = None,
             timeout: float = 300.0) -> Any:
        """Move ``key_groups`` (an iterable of key group ids) to worker ``to`` while the job
        runs; returns the reconfiguration's record once every key group is installed at its
        new owner. ``strategy``: ``"all_at_once"`` (one step), ``"batched"`` with ``batch=n``
        (n key groups per step) or ``"fluid"`` (one key group per step). Raises
        :class:`abs.ReconfigurationError` for a request that cannot be carried out (nothing
        is changed then)."""
        from .errors import ReconfigurationError

        if isinstance(key_groups, int) or (hasattr(type(key_groups), "__index__") and not hasattr(key_groups, "__len__")):
            key_groups = [key_groups]  # one id (a numpy integer too; checked with the others by the driver)
        else:
            try:
                if isinstance(key_groups, (str, bytes)):  # list("12") would ask for key groups '1' and '2'
                    raise TypeError
                key_groups = list(key_groups)
            except TypeError:
                raise ReconfigurationError(
                    f"move(key_groups={key_groups!r}): key_groups must be a key group id or an iterable of them, "
                    "e.g. move([0, 1], to=1)") from None
        return self._reconfigure("move", (key_groups, to), strategy, batch, timeout)

    def rebalance(self, assignment: Any, *, strategy: str = "all_at_once", batch: int | None = None,
                  timeout: float = 300.0) -> Any:
        """Give key groups new owners: ``assignment`` is a list with one worker per key group,
        or a dict ``{key_group: worker}`` of the changes; see :meth:`move`."""
        return self._reconfigure("rebalance", (assignment,), strategy, batch, timeout)

    def rescale(self, workers: int, *, strategy: str = "all_at_once", batch: int | None = None,
                timeout: float = 300.0) -> Any:
        """Change the number of workers of the running job to ``workers`` without stopping it.
        Growing, the executor starts the new workers, which join the dataflow at a step's
        marker, and key groups move to them (the fewest moves that even the shares out);
        shrinking, the leaving workers' key groups move to the others, their source splits
        are handed over at their offsets, a checkpoint commits what their sinks wrote, and
        they stop. ``strategy``/``batch`` as for :meth:`move`. Returns the reconfiguration's
        record; raises :class:`abs.ReconfigurationError` for a request that cannot be carried
        out (nothing is changed then)."""
        return self._reconfigure("rescale", (workers,), strategy, batch, timeout)

    def assignment(self) -> Any:
        """The key-group assignment in force (:class:`abs.reconfig.Assignment`)."""
        return self._driver.assignment

    def reconfigurations(self) -> list:
        """Every reconfiguration of this job so far, oldest first: its steps, key groups,
        bytes moved and timings (:class:`abs.reconfig.ReconfigurationRecord`)."""
        return list(self._driver.reconfigurations)

    def _reconfigure(self, kind: str, args: tuple, strategy: str, batch: Any, timeout: float) -> Any:
        from .errors import ReconfigurationError
        from .runtime.messages import ReconfigRequest

        def not_running(why: str) -> ReconfigurationError:
            # a job that ended (or ends before the driver gets to the request) is a request that
            # cannot be carried out (README), and nothing was changed
            return ReconfigurationError(f"{kind}: {why}; {self._after_the_end()}")

        return self._ask(ReconfigRequest(kind, args, strategy, batch, queue.Queue()), timeout, "reconfiguration",
                         not_running)

    def _after_the_end(self) -> str:
        """What to do instead of reconfiguring a job that is no longer running."""
        if self.status == "FINISHED":
            return "its input has ended: nothing is left to move key groups or workers for"
        if self._driver.storage_url is None:
            return "it ran without storage: there is no checkpoint to continue it from at another parallelism"
        return ("to continue it at another parallelism, run it again with restore='latest' and the number of "
                "workers you want (parallelism=N)")

    def cancel(self) -> JobResult:
        """Stop the job (no final checkpoint) and return its result."""
        reply: "queue.Queue[Any]" = queue.Queue()
        from .runtime.messages import CancelRequest

        self._driver.requests.put(CancelRequest(reply))
        return self.wait()

    def wait(self, timeout: float | None = None) -> JobResult:
        """Block until the job ends; returns its result or raises its error."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"job {self._driver.flow.name!r} still running after {timeout} s")
        if self._exc is not None:
            raise self._exc
        assert self._driver.result is not None
        return self._driver.result

    def metrics(self) -> dict:
        """Live counters: records in per operator uid, checkpoints completed and failed, the
        number of workers, the restarts so far, the load series of the first keyed stage (``load``: one
        :class:`abs.autoscale.LoadSample` per second as a dict: per worker busy share and
        records processed per second, input records per second, the sources' lag, records per
        second per key group), autoscaling decisions, per task the fill of its input buffers,
        the state's bytes per key group in the newest complete checkpoint, and ``subtasks``:
        a series (one sample per ``Autoscale.interval``, else per second) of every subtask's
        busy, idle and backpressured shares and input buffer fill, every operator's records in
        and out per second per subtask, and each worker's source lag
        (:mod:`abs.runtime.subtask_metrics`)."""
        d = self._driver
        return {
            "status": d.status,
            "records_in": d._records_total(),
            "completed_checkpoints": len(d.completed),
            "failed_checkpoints": len(d.failed),
            "last_checkpoint": d.completed[-1].checkpoint_id if d.completed else None,
            "workers": d.P,
            # each restart so far: attempt, error, restored_from, workers (the parallelism it ran at)
            "restarts": [dict(r) for r in list(d.restarts)],
            # the first keyed stage, one sample per Autoscale.interval (when autoscaling)
            "load": [{**s, "key_group_rates": dict(s["key_group_rates"])} for s in list(d.load_dicts)],
            "autoscale_decisions": d.autoscale_report(),
            # per task: the share of its input buffers in use (a full one backpressures its senders)
            "queue_fill": {k: v for w in list(d._worker_metrics.values()) for k, v in w.queue_fill.items()},
            # keyed operator uid -> key group -> bytes of its state in the newest complete checkpoint
            "state_bytes": d.state_bytes(),
            # per subtask over time: busy/idle/backpressured, queue fill, records in/out per second
            "subtasks": list(d.subtask_series),
        }


def _check_timeout(timeout: Any, what: str) -> None:
    if type(timeout) not in (int, float) or not math.isfinite(timeout) or timeout <= 0:
        raise ConfigError(f"{what}: timeout must be a positive number of seconds, got {timeout!r}; pass e.g. "
                          "timeout=60.0")


def _cancel_request() -> Any:
    from .runtime.messages import CancelRequest

    return CancelRequest(queue.Queue())


@_takes_job_options
def submit(flow: Dataflow, **options: Any) -> JobHandle:
    """Start ``flow`` in the background; see :func:`run` for the arguments."""
    o = _job_options("submit", options)
    return JobHandle(_driver(flow, o), dashboard=o.dashboard)
