"""The driver: hosts the checkpoint coordinator and the source split enumerators, commits
manifests, and runs the job's attempts. Its parts, one module each:

* :mod:`abs.runtime.executors` where workers run, :mod:`abs.runtime.supervision` launching
  and supervising them, :mod:`abs.runtime.restore_setup` what an attempt restores and what
  each worker owns, :mod:`abs.runtime.lifecycle` the pure job-lifecycle state machine (final
  checkpoint, finish, failover), :mod:`abs.runtime.results` what a job reports;
* here: the attempt loop and the message loop, a dispatch over the typed messages of
  :mod:`abs.runtime.messages`, and the commit of checkpoints.

The coordinator (:mod:`abs.coordinator`) is pure; this module turns its actions into messages
and storage calls:

    Trigger(n)         -> TriggerCheckpoint to every worker (source tasks inject barrier n)
    Abort(n)           -> CheckpointAborted to every worker (tasks aligning n stop, cancel markers flow)
    Commit(n, acks)    -> manifest n written atomically (the commit point), then
    NotifyComplete(n)  -> CheckpointCompleted to every worker (sinks commit, deltas are confirmed)
"""
from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
import uuid
from multiprocessing.connection import wait
from typing import Any, Callable

from ..config import CheckpointConfig, RestartStrategy
from ..coordinator import Abort, CheckpointCoordinator, Commit, FailJob, NotifyComplete, Trigger
from ..dataflow import Dataflow
from ..faults import normalize_faults
from ..errors import CheckpointFailedError, ConfigError, JobFailedError, OperatorError, WorkerLostError
from ..keygroups import routing_table
from ..connectors.sinks import CollectSink
from storage.backend import absolute_url
from storage.errors import StorageError

from . import lifecycle as life
from . import messages as m
from .cleanup import BackgroundGc
from .completion import CheckpointCompletion
from .executors import LocalExecutor
from .failures import should_restart
from .plan import compile_plan
from .autoscaling import Autoscaling
from .capacity import Capacity
from .reconfigure import LiveReconfiguration
from .restore import check_restore_option
from .restore_setup import RESTORE_WORDS, RestoreSetup, RestoreState
from .results import CheckpointStats, JobResult
from .supervision import Supervision, wait_for_exits
from .worker import WorkerSpec

__all__ = ["JobDriver", "CheckpointStats", "JobResult", "LocalExecutor"]

WRITER_TIMEOUT_FACTOR = 1.5
"""A worker's uploader waits on its snapshot writer process at most this many times the
checkpoint timeout for one write, then kills it (see ``Worker._write``). Past the checkpoint
timeout itself the driver has aborted the checkpoint anyway, so a writer that is merely slow
never costs a checkpoint that could still complete; the half on top lets the abort come first."""


@dataclasses.dataclass
class _Attempt:
    """What the message loop of one attempt works with."""

    procs: list
    conns: dict  # worker index -> control connection
    coord: CheckpointCoordinator
    life: life.JobLifecycle
    by_conn: dict  # id(connection) -> worker index
    trigger_times: dict = dataclasses.field(default_factory=dict)
    # messages of running workers read while the driver waited on joining ones (a rescale's
    # start-up: Rescaling._watch_running), handled by the loop first, in the order they came
    deferred: collections.deque = dataclasses.field(default_factory=collections.deque)


class JobDriver(RestoreSetup, Supervision, CheckpointCompletion, LiveReconfiguration, Autoscaling, Capacity):
    """One job: its attempts, their message loops, its checkpoints' commits."""

    def __init__(
        self,
        flow: Dataflow,
        *,
        parallelism: int,
        checkpoint: CheckpointConfig | None,
        storage: str | None,
        storage_options: dict | None,
        restore: Any,
        executor: Any,
        restart: RestartStrategy | None = None,
        allow_non_restored_state: bool = False,
        faults: tuple = (),
        startup_timeout: float = 120.0,
        heartbeat_timeout: float = 60.0,
        allow_repeated_output: bool = False,
        progress: Any = None,
        autoscale: Any = None,
    ) -> None:
        flow.validate()
        if not isinstance(parallelism, int) or parallelism < 1:
            raise ConfigError(f"parallelism must be a positive integer, got {parallelism!r}")
        if parallelism > flow.max_parallelism:
            raise ConfigError(
                f"parallelism {parallelism} exceeds max_parallelism {flow.max_parallelism} of dataflow {flow.name!r}; "
                "lower the parallelism, or re-key a snapshot offline into a larger max_parallelism "
                "(abs-snapshot rekey ROOT ID DEST --max-parallelism N) and restore the job from it"
            )
        self.flow = flow
        self.P = parallelism
        self.config = checkpoint or CheckpointConfig()
        self.checkpointing = storage is not None and (checkpoint is not None)
        if flow.has_loops and self.config.priority_barriers:
            raise ConfigError(f"dataflow {flow.name!r} has an iteration: unaligned checkpoints (and alignment_timeout) "
                              "do not snapshot loops yet; use mode='aligned' without alignment_timeout")
        if flow.has_loops and self.config.mode == "stop_the_world":
            raise ConfigError(f"dataflow {flow.name!r} has an iteration: checkpoint mode 'stop_the_world' cannot snapshot "
                              "loops (the head's part waits for the barrier to come round); use mode='aligned'")
        if checkpoint is not None and storage is None:
            raise ConfigError("checkpoint= needs storage= (a path or fsspec URL where snapshots are written)")
        check_restore_option(restore, storage)
        # a relative path is resolved here, in the driver: a worker started elsewhere (a Spark
        # executor's work directory) would resolve it against its own directory
        storage = absolute_url(storage) if isinstance(storage, str) else storage
        if isinstance(restore, str) and restore not in RESTORE_WORDS:
            restore = absolute_url(restore)  # a savepoint path
        self.storage_url = storage
        self.storage_options = storage_options
        self.restore = restore
        self.executor = executor or LocalExecutor()
        if hasattr(self.executor, "check"):
            # sources whose own Spark query needs task slots of the executor's application
            queries = [(n.uid, n.spec["source"]) for n in flow.nodes
                       if n.kind == "source" and getattr(n.spec["source"], "spark_query_slots", 0)]
            if queries:
                self.executor.check(parallelism, storage, queries=queries)
            else:
                self.executor.check(parallelism, storage)
        self.faults = normalize_faults(faults)
        self._attempt = 0
        self._driver_hits: dict = {}
        self.restart = restart or RestartStrategy()
        self.allow_non_restored_state = allow_non_restored_state
        self.allow_repeated_output = allow_repeated_output
        self._restore_state = RestoreState()
        self.restarts: list[dict] = []
        self.startup_timeout = startup_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.progress = progress  # restore progress: None (bars on a terminal), False, or a callback
        self.plan = compile_plan(flow)
        self.requests: "queue.Queue[Any]" = queue.Queue()  # CheckpointRequest / CancelRequest / ReconfigRequest
        self.store = None
        self._collected: dict[str, list[bytes]] = {}
        self._staged: dict[str, tuple[str, list[bytes]]] = {}  # CollectSink epochs awaiting commit
        self._collect_sinks = [n.uid for n in flow.nodes if n.kind == "sink" and isinstance(n.spec["sink"], CollectSink)]
        self._collected_ids: dict[str, list[int]] = {}  # checkpoint id of each entry of _collected
        # a sink that cannot roll back needs the commit record to see a deleted newest manifest
        self._record_commits = any(n.kind == "sink" and not n.spec["sink"].supports_rollback for n in flow.nodes)
        self._records: dict[int, dict] = {}
        # task key -> its two latest Task.load() samples (older, newer): busy, idle and
        # backpressured shares over the half second between them (abs.observe)
        self.task_load: dict[str, tuple] = {}
        self._bytes_restored: list[int] = [0] * parallelism
        self._restore_seconds: list[float] = [0.0] * parallelism
        # per worker, the key groups it restored (uid -> state -> key groups), as it reported them
        self.restored_key_groups: list[dict] = [{} for _ in range(parallelism)]
        self.completed: list[CheckpointStats] = []
        self.checkpoint_tasks: dict[int, dict] = {}  # recent checkpoints' per-task figures (abs.observe)
        self.failed: list[tuple[int, str]] = []
        self.restored_from: int | None = None
        self.status = "CREATED"
        self._probe: str | None = None
        self._manifests: dict[int, Any] = {}  # recent committed manifests (GC protection of bases)
        self._gc = BackgroundGc()  # retention runs off the loop (see abs.runtime.cleanup)
        self._bases: dict[int, int] = {}  # checkpoint id -> newest complete id when it was triggered
        self._last_completed_id = 0
        self.run_id = uuid.uuid4().hex  # manifests' lineage: which run wrote them
        self._follows: Any = None  # the manifest the next one follows (lineage), as stored
        self._waiters: dict[int, "queue.Queue[Any]"] = {}
        self._loops_quiet: dict[int, bool] = {}  # checkpoint id -> its feedback logs were all empty
        self._done = threading.Event()
        self.result: JobResult | None = None
        self.error: BaseException | None = None
        self.clock: Callable[[], float] = time.monotonic  # the loop's time (the coordinator's too)
        self._reconfig_init()
        self._autoscale_init(autoscale)
        self._capacity_init()
        if self.restart.min_workers is not None and self.restart.min_workers > parallelism:
            raise ConfigError(f"RestartStrategy.min_workers={self.restart.min_workers} is more than the job's "
                              f"parallelism {parallelism}; pass at most {parallelism}")

    def _spec(self, restore_info: dict, attempt: int = 0) -> WorkerSpec:
        return WorkerSpec(
            flow=self.flow,
            parallelism=self.P,
            routing=routing_table(self.flow.max_parallelism, self.P),
            checkpointing=self.checkpointing,
            checkpoint_mode=self.config.mode,
            storage_url=self.storage_url,
            storage_probe=self._probe,
            storage_options=self.storage_options,
            restore_url=restore_info.get("url"),
            restore_storage_options=restore_info.get("options"),
            faults=tuple(f for f in self.faults if f.attempt == attempt and f.point not in ("before_commit", "after_commit")),
            writer_timeout=WRITER_TIMEOUT_FACTOR * self.config.timeout,
            alignment_timeout=self.config.alignment_timeout,
        )

    # ------------------------------------------------------------------ run
    def run(self) -> JobResult:
        t_start = time.monotonic()
        self.t_start = t_start
        attempt = 0
        while True:
            procs: list = []
            conns: dict[int, Any] = {}
            try:
                self._attempt = attempt
                self._capacity_attempt(attempt)
                first_id, restore_info = self._open_storage()
                spec = self._spec(restore_info, attempt)
                assignments = self._assignments(restore_info)
                self._track_splits(assignments)
                self._open_sources(restore_info, attempt)
                self._reconfig_reset()
                self._launch(spec, assignments, procs, conns)
                self._t_started = time.monotonic()
                self.status = "RUNNING"
                self._loop(procs, conns, first_id)
                self.status = "FINISHED"
                break
            except Exception as exc:
                # anything from opening the root to the last record fails this attempt; the
                # restart strategy retries it unless the error is permanent (abs.runtime.failures)
                canceled = isinstance(exc, _Canceled)
                decision = life.failover(attempt, canceled=canceled, restartable=not canceled and should_restart(exc),
                                         max_restarts=self.restart.max_restarts,
                                         delay=self.restart.delay_before(attempt + 1))
                if isinstance(decision, life.Stop):
                    gave_up = not canceled and should_restart(exc)  # restartable, but no restart left
                    self.status, self.error = decision.status, (self._gave_up(exc) if gave_up else exc)
                    break
                attempt = decision.attempt
                self._teardown(procs, conns)
                procs, conns = [], {}
                self._prepare_restart(attempt, exc, decision.delay)
            except BaseException as exc:
                self.status, self.error = "FAILED", exc
                break
            finally:
                self._teardown(procs, conns)
                self._close_sources()
                self._gc.drain()  # when run() returns, retention has been applied
        self._reconfig_ended()
        self._gc.close()  # no thread left behind per job
        self.result = JobResult(
            job_name=self.flow.name,
            status=self.status,
            parallelism=self.P,
            duration=time.monotonic() - t_start,
            completed_checkpoints=list(self.completed),
            failed_checkpoints=list(self.failed),
            restarts=list(self.restarts),
            restored_from=self.restored_from,
            records_in=self._records_total(),
            bytes_restored_per_worker=list(self._bytes_restored),
            restore_seconds_per_worker=list(self._restore_seconds),
            timings=self._timings(t_start),
            error=None if self.error is None else str(self.error),
            skipped_checkpoints=list(self._restore_state.skipped),
            rolled_back={uid: sorted(ids) for uid, ids in self._restore_state.rolled_back.items()},
            repeated_output={uid: sorted(ids) for uid, ids in self._restore_state.repeated.items()},
            autoscale_decisions=self.autoscale_report(),
            collect_sinks=tuple(self._collect_sinks),
            _collected=self._collected,
        )
        self._done.set()
        if self.status == "FAILED":
            err = self.error
            if isinstance(err, JobFailedError):
                err.result = self.result
                raise err
            if isinstance(err, (ConfigError, StorageError)) or not isinstance(err, Exception):
                if isinstance(err, StorageError):
                    err.result = self.result  # type: ignore[attr-defined]  # the restarts before it
                raise err  # type: ignore[misc]
            raise JobFailedError(f"job {self.flow.name!r} failed: {err}", self.result) from err
        return self.result

    def _timings(self, t_start: float) -> dict:
        end = time.monotonic()
        started = getattr(self, "_t_started", end)
        exhausted = getattr(self, "_t_exhausted", end)
        return {
            "startup_s": started - t_start,
            "processing_s": max(exhausted - started, 1e-9),
            "finishing_s": end - exhausted,
        }

    def _records_total(self) -> dict[str, int]:
        total: dict[str, int] = dict(self._retired_records)  # workers that left (a rescale)
        for per_worker in self._records.values():
            for uid, n in per_worker.items():
                total[uid] = total.get(uid, 0) + n
        return total

    # ------------------------------------------------------------------ main loop
    def _loop(self, procs: list, conns: dict, first_id: int) -> None:
        expected = self.plan.task_keys(self.P)
        source_keys = {k for k in expected if self.plan.tasks[int(k[4:].split("#")[0])].is_source}
        coord = CheckpointCoordinator(self.config, expected, first_id, clock=self.clock)
        self.coord = coord
        run = _Attempt(procs, conns, coord,
                       life.JobLifecycle(expected, source_keys, conns, checkpointing=self.checkpointing,
                                         heartbeat_timeout=self.heartbeat_timeout, now=self.clock(),
                                         loops=self.flow.has_loops or self.config.priority_barriers,
                                         periodic=self.checkpointing and self.config.interval is not None),
                       {id(c): i for i, c in conns.items()})
        while True:
            self._check_procs(procs, conns)
            while run.deferred:  # read during a join's start-up: before anything newer of theirs
                i, msg = run.deferred.popleft()
                self._on_message(run, i, msg)
            for conn in wait(list(conns.values()), timeout=0.02):
                i = run.by_conn[id(conn)]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    self._connection_lost(run, i)
                run.life.on_seen(i, self.clock())
                self._on_message(run, i, msg)
            for silent in run.life.silent_workers(self.clock()):
                raise WorkerLostError(
                    f"job {self.flow.name!r}: worker {silent.worker} sent nothing for {silent.silent_for:.0f} s "
                    "(heartbeat timeout); it is hung or overloaded"
                )
            self._serve_requests(run)
            self._rescale_tick(run)
            self._autoscale_tick(run)
            self._capacity_tick(run)
            if self._after_round(run):
                return

    def _after_round(self, run: _Attempt) -> bool:
        """Carry out the lifecycle's actions after a round of messages; True once shut down."""
        for action in run.life.tick(bool(run.coord.pending_ids())):
            match action:
                case life.ShutDown():
                    self._broadcast(run, m.Shutdown())
                    self._collect_done(run.conns, run.procs)
                    self._sample_subtasks(self.clock())  # the subtask series ends at the final counts
                    return True
                case life.FinishSources():
                    self._broadcast(run, m.Finish())
                case life.GiveUp(attempts=n):
                    raise CheckpointFailedError(
                        f"job {self.flow.name!r}: the final checkpoint failed {n} times "
                        f"(last: {self.failed[-1][1] if self.failed else '?'}); output since the last complete "
                        "checkpoint is not committed"
                    )
                case life.RequestFinalCheckpoint():
                    run.coord.request()
                case life.TickCoordinator():
                    self._handle(run, run.coord.tick())
        return False

    def _connection_lost(self, run: _Attempt, i: int) -> None:
        """Worker ``i``'s connection closed: name the dead worker (its exit status may take a
        moment to arrive), else report the lost connection."""
        wait_for_exits(run.procs[i:i + 1], 0.2, lambda: self._check_procs(run.procs, run.conns))
        raise WorkerLostError(f"job {self.flow.name!r}: lost the connection to worker {i}")

    def _on_message(self, run: _Attempt, i: int, msg: Any) -> None:
        """One message of worker ``i``."""
        coord = run.coord
        match msg:
            case m.Ack():
                self._handle(run, coord.on_ack(msg.checkpoint_id, msg.task, msg.ack))
            case m.Decline():
                actions = coord.on_decline(msg.checkpoint_id, msg.task, msg.reason)
                if not actions:
                    self._late_decline(msg.checkpoint_id, msg.task, msg.reason)
                self._handle(run, actions)
            case m.Collect() | m.CollectCommit():
                self._on_collect(msg)
            case m.Metrics():
                self._records[msg.index] = msg.metrics.records_in
                self._worker_metrics[msg.index] = msg.metrics
                for key, sample in msg.metrics.load.items():
                    self.task_load[key] = (self.task_load.get(key, (None, None))[1], sample)
            case m.SourceExhausted():
                if self.is_stale_exhaustion(msg):
                    pass  # splits were handed to it meanwhile (a rescale): it reads again
                elif run.life.on_source_exhausted(msg.task):
                    self._t_exhausted = self.clock()
            case m.TaskDone():
                run.life.on_task_done(msg.task)
                coord.on_task_finished(msg.task)
                self._on_leaving_done(run, msg.task)
            case m.KeyGroupHandover() | m.KeyGroupInstalled() | m.PeersAdded() | m.SplitsHandover():
                self._on_reconfig_message(run, msg)
            case m.Done():
                self._on_worker_done(run, i, msg)  # a worker leaving the job (a rescale)
            case m.Heartbeat():
                pass  # a starting worker's (see worker_main.main); a running one sends Metrics
            case m.TaskFailed():
                # a task often fails only because a peer worker died (its channel broke):
                # name the dead worker, not the collateral failure
                wait_for_exits(run.procs, 0.5, lambda: self._check_procs(run.procs, run.conns))
                self._handle(run, coord.on_task_failed(msg.task))
                raise OperatorError(
                    f"job {self.flow.name!r}: operator {msg.uid!r} failed in {msg.task} (worker {i}):\n{msg.traceback}"
                )
            case _:
                raise m.unexpected(msg, f"job {self.flow.name!r}: the driver", f"worker {i}")

    def _broadcast(self, run: _Attempt, msg: Any) -> None:
        for c in run.conns.values():
            try:
                c.send(msg)
            except OSError:
                pass

    def _handle(self, run: _Attempt, actions: list) -> None:
        """Carry out the coordinator's actions."""
        for a in actions:
            match a:
                case Trigger():
                    run.trigger_times[a.checkpoint_id] = self.clock()
                    run.life.on_triggered(a.checkpoint_id)
                    base = self._last_completed_id
                    self._bases[a.checkpoint_id] = base
                    self._record_assignment(a.checkpoint_id)
                    self._broadcast(run, m.TriggerCheckpoint(a.checkpoint_id, base))
                case FailJob():
                    raise CheckpointFailedError(f"job {self.flow.name!r}: {a.reason}")  # the reason says what to do
                case Abort():
                    self.failed.append((a.checkpoint_id, a.reason))
                    self._broadcast(run, m.CheckpointAborted(a.checkpoint_id, a.reason))
                    if self.config.mode == "stop_the_world":
                        self._broadcast(run, m.Resume(a.checkpoint_id))
                    self._notify_waiter(a.checkpoint_id, JobFailedError(f"checkpoint {a.checkpoint_id} failed: {a.reason}"))
                    run.life.on_aborted(a.checkpoint_id)
                case Commit():
                    # nothing in flight at the cut: no loop record logged, no record overtaken by an
                    # unaligned barrier (the final checkpoint must cover every record: see lifecycle)
                    self._loops_quiet[a.checkpoint_id] = all(
                        (ack.loop_records or 0) == 0 and ack.channel_records == 0 for ack in a.acks.values())
                    if not self.checkpointing:  # a loop's termination probe: nothing to store
                        self._handle(run, run.coord.on_committed(a.checkpoint_id))
                        continue
                    try:
                        self._driver_fault("before_commit", run.procs)
                        self._commit(a, run.trigger_times.get(a.checkpoint_id, a.started_at))
                        self._driver_fault("after_commit", run.procs)
                    except Exception as exc:  # noqa: BLE001 - a failed commit fails the checkpoint only
                        self._handle(run, run.coord.on_commit_failed(a.checkpoint_id, f"{type(exc).__name__}: {exc}"))
                        continue
                    self._handle(run, run.coord.on_committed(a.checkpoint_id))
                case NotifyComplete():
                    self._broadcast(run, m.CheckpointCompleted(a.checkpoint_id))
                    if self.config.mode == "stop_the_world":
                        self._broadcast(run, m.Resume(a.checkpoint_id))
                    self._notify_waiter(a.checkpoint_id, a.checkpoint_id)
                    quiet = self._loops_quiet.pop(a.checkpoint_id, True)
                    for action in run.life.on_completed(a.checkpoint_id, quiet):
                        if isinstance(action, life.FinishSources):
                            self._broadcast(run, m.Finish())

    def _late_decline(self, cid: int, task: str, reason: str) -> None:
        """A decline for a checkpoint that has already failed (e.g. its timeout fired while a
        task's snapshot writer hung): its reason joins the failure's, so that
        ``JobResult.failed_checkpoints`` names the cause, not only the timeout."""
        for k, (failed_id, why) in enumerate(self.failed):
            if failed_id == cid and reason not in why:
                self.failed[k] = (cid, f"{why}; then declined by {task}: {reason}")
                return

    def _serve_requests(self, run: _Attempt) -> None:
        """The requests of the job's :class:`~abs.JobHandle` (checkpoint now, cancel)."""
        coord = run.coord
        while True:
            try:
                req = self.requests.get_nowait()
            except queue.Empty:
                return
            if isinstance(req, m.CancelRequest):
                self._broadcast(run, m.Stop())
                raise _Canceled()
            if isinstance(req, m.ReconfigRequest):
                self._serve_reconfig(run, req)
                if req.kind == "rescale" and self._reconf is not None and self._reconf_reply is req.reply:
                    self.wanted_workers = req.args[0]  # the user's parallelism from now on
                continue
            if not isinstance(req, m.CheckpointRequest):
                raise m.unexpected(req, f"job {self.flow.name!r}: the driver", "its JobHandle")
            reply = req.reply
            if not self.checkpointing:
                reply.put(JobFailedError("checkpointing is off for this job (no storage= or checkpoint=)"))
                continue
            cid = coord.request()
            if cid is None:
                cid = coord.queued_id() if hasattr(coord, "queued_id") else None
            if cid is None:
                reply.put(JobFailedError("could not trigger a checkpoint now; try again"))
            else:
                self._waiters[cid] = reply
            self._handle(run, coord.tick())

    def _notify_waiter(self, cid: int, value: Any) -> None:
        q = self._waiters.pop(cid, None)
        if q is not None:
            q.put(value)


class _Canceled(Exception):
    pass
