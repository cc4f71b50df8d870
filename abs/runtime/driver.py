"""The driver: launches workers, hosts the checkpoint coordinator and the source split
enumerators, commits manifests, and supervises the job.

The coordinator (:mod:`abs.coordinator`) is pure; this module is the thin layer that turns
its actions into messages and storage calls:

    Trigger(n)         -> TriggerCheckpoint to every worker (source tasks inject barrier n)
    Abort(n)           -> CheckpointAborted to every worker (tasks aligning n stop, cancel markers flow)
    Commit(n, acks)    -> manifest n written atomically (the commit point), then
    NotifyComplete(n)  -> CheckpointCompleted to every worker (sinks commit, deltas are confirmed)

The messages are those of :mod:`abs.runtime.messages`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import queue
import secrets
import subprocess
import sys
import threading
import time
import uuid
from multiprocessing.connection import Listener, wait
from typing import Any

import pyarrow as pa

from ..config import CheckpointConfig, RestartStrategy
from ..coordinator import Abort, CheckpointCoordinator, Commit, FailJob, NotifyComplete, Trigger
from ..dataflow import Dataflow
from ..faults import normalize_faults, trip
from ..errors import CheckpointFailedError, ConfigError, JobFailedError, OperatorError, StartupError, WorkerLostError
from ..keygroups import routing_table
from ..connectors.sinks import CollectSink
from storage.backend import absolute_url
from storage.errors import StorageError

from . import messages as m
from .cleanup import BackgroundGc, GcRequest
from .failures import should_restart
from .restore import SinkView, check_restore_option, committed_evidence, id_ranges, plan_output
from .plan import compile_plan
from .worker import WorkerSpec

# restore= values that are words, not savepoint paths
_RESTORE_WORDS = ("latest", "latest-if-any", "fresh")

__all__ = ["JobDriver", "CheckpointStats", "JobResult", "LocalExecutor"]

WRITER_TIMEOUT_FACTOR = 1.5
"""A worker's uploader waits on its snapshot writer process at most this many times the
checkpoint timeout for one write, then kills it (see ``Worker._write``). Past the checkpoint
timeout itself the driver has aborted the checkpoint anyway, so a writer that is merely slow
never costs a checkpoint that could still complete; the half on top lets the abort come first."""


@dataclasses.dataclass(frozen=True)
class CheckpointStats:
    """One completed checkpoint as the driver saw it."""

    checkpoint_id: int
    trigger_time: float  # seconds since job start
    duration: float  # trigger to manifest committed
    alignment_time: float  # max over tasks
    sync_time: float  # max over tasks: synchronous part of the snapshot
    async_time: float  # max over tasks: encoding + upload
    bytes_written: int
    full_size: int
    files_written: int
    async_cpu: float = 0.0  # sum over tasks: CPU seconds of the asynchronous part (uploader + writer process)


@dataclasses.dataclass
class JobResult:
    """What :func:`abs.run` returns (and :meth:`abs.JobHandle.wait`)."""

    job_name: str
    status: str  # FINISHED | FAILED | CANCELED
    parallelism: int
    duration: float
    completed_checkpoints: list[CheckpointStats]
    failed_checkpoints: list[tuple[int, str]]
    restarts: list[dict]
    restored_from: int | None
    records_in: dict[str, int]
    bytes_restored_per_worker: list[int]
    restore_seconds_per_worker: list[float] = dataclasses.field(default_factory=list)
    timings: dict = dataclasses.field(default_factory=dict)  # startup_s, processing_s, finishing_s
    error: str | None = None
    # restores that fell back (see abs.runtime.restore): (id, reason) of each checkpoint skipped,
    # sink uid -> ids whose committed output was rolled back / is published again
    skipped_checkpoints: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    rolled_back: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    repeated_output: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    _collected: dict[str, list[bytes]] = dataclasses.field(default_factory=dict, repr=False)

    def collected(self, uid: str) -> pa.Table:
        """Every record a :class:`abs.CollectSink` with this uid received."""
        from .channels import decode

        batches = [decode(b) for b in self._collected.get(uid, [])]
        if not batches:
            return pa.table({})
        return pa.Table.from_batches(batches).combine_chunks() if len({b.schema for b in batches}) == 1 else pa.concat_tables(
            [pa.Table.from_batches([b]) for b in batches], promote_options="default"
        )

    @property
    def last_checkpoint(self) -> int | None:
        return self.completed_checkpoints[-1].checkpoint_id if self.completed_checkpoints else None


class LocalExecutor:
    """Runs the workers as processes on this machine (the embedded default).

    ``pin_cpus=True`` binds worker ``i`` to one CPU, the ``i mod N``-th of the ``N`` CPUs
    this process may run on (Linux, ``sched_setaffinity``); each worker's snapshot writer
    process stays free to run on any of them. A worker's Python threads (task threads,
    source readers, the uploader) share one GIL, so it uses about one CPU at a time; kept on
    one CPU, the GIL's hand-overs between its threads stay in one core's caches. Measured on
    2 cores in interleaved rounds: +13 % throughput of the keyed ``process`` job without
    checkpoints at p=1 (5 of 5 rounds higher), +15 % with ABS at p=2 (3 of 4 rounds); runs
    of the reference workload an hour later, one setting after the other, were mixed, and the
    ABS cost relative to "off" did not shrink. Off by default: jobs sharing a machine would
    pin their workers to the same CPUs.
    """

    def __init__(self, *, pin_cpus: bool = False) -> None:
        if pin_cpus and not hasattr(os, "sched_setaffinity"):
            raise ConfigError("LocalExecutor(pin_cpus=True) needs os.sched_setaffinity (Linux); leave pin_cpus off here")
        self.pin_cpus = pin_cpus
        self._cpus = sorted(os.sched_getaffinity(0)) if pin_cpus else []

    def launch(self, index: int, boot: dict) -> subprocess.Popen:
        if self.pin_cpus:
            boot = {**boot, "cpu": self._cpus[index % len(self._cpus)]}
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        proc = subprocess.Popen(
            [sys.executable, "-c", "from abs.runtime.worker import main; main()"], stdin=subprocess.PIPE, env=env, close_fds=True
        )
        assert proc.stdin is not None
        proc.stdin.write((json.dumps(boot) + "\n").encode())
        proc.stdin.close()
        return proc


class JobDriver:
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
        if checkpoint is not None and storage is None:
            raise ConfigError("checkpoint= needs storage= (a path or fsspec URL where snapshots are written)")
        check_restore_option(restore, storage)
        # a relative path is resolved here, in the driver: a worker started elsewhere (a Spark
        # executor's work directory) would resolve it against its own directory
        storage = absolute_url(storage) if isinstance(storage, str) else storage
        if isinstance(restore, str) and restore not in _RESTORE_WORDS:
            restore = absolute_url(restore)  # a savepoint path
        self.storage_url = storage
        self.storage_options = storage_options
        self.restore = restore
        self.executor = executor or LocalExecutor()
        if hasattr(self.executor, "check"):
            self.executor.check(parallelism, storage)
        self.faults = normalize_faults(faults)
        self._attempt = 0
        self._driver_hits: dict = {}
        self.restart = restart or RestartStrategy()
        self.allow_non_restored_state = allow_non_restored_state
        self.allow_repeated_output = allow_repeated_output
        self._restore_state = _RestoreState()
        self.restarts: list[dict] = []
        self.startup_timeout = startup_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.plan = compile_plan(flow)
        self.requests: "queue.Queue[Any]" = queue.Queue()  # CheckpointRequest / CancelRequest
        self.store = None
        self._collected: dict[str, list[bytes]] = {}
        self._staged: dict[str, tuple[str, list[bytes]]] = {}  # CollectSink epochs awaiting commit
        self._collect_sinks = [n.uid for n in flow.nodes if n.kind == "sink" and isinstance(n.spec["sink"], CollectSink)]
        self._collected_ids: dict[str, list[int]] = {}  # checkpoint id of each entry of _collected
        # a sink that cannot roll back needs the commit record to see a deleted newest manifest
        self._record_commits = any(n.kind == "sink" and not n.spec["sink"].supports_rollback for n in flow.nodes)
        self._records: dict[int, dict] = {}
        self._bytes_restored: list[int] = [0] * parallelism
        self._restore_seconds: list[float] = [0.0] * parallelism
        # per worker, the key groups it restored (uid -> state -> key groups), as it reported them
        self.restored_key_groups: list[dict] = [{} for _ in range(parallelism)]
        self.completed: list[CheckpointStats] = []
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
        self._done = threading.Event()
        self.result: JobResult | None = None
        self.error: BaseException | None = None

    # ------------------------------------------------------------------ set-up
    def _open_storage(self) -> tuple[int, dict]:
        """Open the store, check the job fingerprint, resolve what to restore."""
        self._follows = None
        if self.storage_url is not None:
            from storage import SnapshotStore

            self.store = SnapshotStore.open(self.storage_url, self.storage_options)
            self.store.init_job(self.flow.fingerprint())
            if not self.storage_url.startswith("memory://"):  # memory:// is each process's own
                self._probe = self.store.write_probe()  # every worker checks it sees this root
        if self.store is None and self.restore is None:
            return 1, {}
        return self._resolve_restore()

    def _resolve_restore(self) -> tuple[int, dict]:
        """Pick the checkpoint to restore (falling back past broken ones for "latest"; see
        :mod:`abs.runtime.restore` for the options), check it against the job, roll the sinks
        back to it, and plan what every new subtask reads. Returns ``(first id, restore info)``."""
        from recovery import check, plan_restore

        rs = self._restore_state
        evidence, in_root = self._committed_evidence()
        choice, store, url, opts, fresh_why = self._choose(evidence, in_root)
        cid = choice.checkpoint_id if choice is not None else None
        skipped = list(choice.skipped) if choice is not None else []
        for w in (choice.warnings if choice is not None else []):
            print(f"[abs] warning: {w}", file=sys.stderr)
        for sk in skipped:
            if all(sk.checkpoint_id != i for i, _ in rs.skipped):
                rs.skipped.append((sk.checkpoint_id, sk.reason))
        manifest = plan = None
        sources = {n.uid: n.spec["source"] for n in self.flow.nodes if n.kind == "source"}
        if cid is not None:
            fingerprint = self.flow.fingerprint()
            check(
                fingerprint, store, checkpoint_id=cid, parallelism=self.P, verify_files=False,
                allow_non_restored_state=self.allow_non_restored_state,
            ).raise_if_fatal()
            manifest = store.read_manifest(cid)
            plan = plan_restore(
                manifest, fingerprint, self.P,
                source_splits={uid: list(src.splits()) for uid, src in sources.items()},
                allow_non_restored_state=self.allow_non_restored_state,
            )
        # what the sinks must undo: decided before anything is changed, carried out before any worker starts
        target = cid if cid is not None else (rs.run_first_id - 1 if rs.started else None)
        undo = self._plan_output(target, evidence, skipped, cid, url) if target is not None else None
        first_id = max([self.store.next_checkpoint_id() if self.store is not None else 1,
                        (cid or 0) + 1, max(evidence, default=0) + 1])
        if not rs.started:
            rs.started, rs.run_first_id = True, first_id
        job = f"[abs] job {self.flow.name!r}"
        if cid is None:
            print(f"{job}: starting fresh ({fresh_why}); first checkpoint id {first_id}", file=sys.stderr)
        else:
            # the short reasons here; the warnings above carry the details
            why = (f" (skipped {'; '.join(f'{sk.checkpoint_id}: {sk.reason.split(chr(40))[0].strip()}' for sk in skipped)})"
                   if skipped else "")
            print(f"{job}: restoring checkpoint {cid} of {url}{why}", file=sys.stderr)
        if undo is not None:
            self._roll_back_output(*undo)
        if cid is None:
            return first_id, {}
        if manifest.stats.get("parallelism") not in (None, self.P):
            print(f"[abs] rescaling checkpoint {cid} from parallelism {manifest.stats.get('parallelism')} "
                  f"to {self.P}", file=sys.stderr)
        self.restored_from = cid
        if self.restarts:
            self.restarts[-1]["restored_from"] = cid
            self.restarts[-1]["skipped"] = [(sk.checkpoint_id, sk.reason) for sk in skipped]
        if url == self.storage_url:
            # new checkpoints build on the restored chains: keep them from GC like a base
            self._manifests[cid] = manifest
            self._last_completed_id = cid
            self._follows = manifest
        return first_id, {"manifest": manifest, "plan": plan, "url": url, "options": opts, "sources": sources}

    def _committed_evidence(self) -> tuple[dict[int, str], bool]:
        """Checkpoint ids known to have committed (see ``restore.committed_evidence``), and
        whether the storage root itself shows any (a manifest file or the commit record)."""
        from storage.errors import CorruptManifestError

        manifest_ids: list[int] = []
        recorded = None
        if self.store is not None:
            manifest_ids = list(self.store.manifest_ids())
            try:
                recorded = self.store.recorded_committed()
            except CorruptManifestError as exc:
                print(f"[abs] warning: {exc}; a deleted newest manifest would go unnoticed", file=sys.stderr)
        sink_ids = {n.uid: n.spec["sink"].committed_checkpoints() for n in self.flow.nodes
                    if n.kind == "sink" and n.spec["sink"].supports_rollback}
        evidence = committed_evidence(manifest_ids, recorded, sink_ids, (c.checkpoint_id for c in self.completed))
        return evidence, bool(manifest_ids) or recorded is not None

    def _choose(self, evidence: dict[int, str], in_root: bool) -> tuple[Any, Any, Any, Any, str]:
        """``(choice or None, store, url, options, why fresh)`` for this attempt. Output left in
        a sink counts as a sign of a lost checkpoint only when the root shows checkpoints too
        (``in_root``): a sink's files next to an empty root are another run's."""
        from recovery import RestoreChoice, choose_restore
        from recovery.errors import NoUsableCheckpointError
        from storage import SnapshotStore

        rs, r, store, url = self._restore_state, self.restore, self.store, self.storage_url
        opts = self.storage_options
        known = {cid: why for cid, why in evidence.items() if why != "its manifest exists"
                 and (in_root or rs.started or not why.startswith("sink "))}
        if rs.started:  # a restart: this run's newest checkpoint, else what the run started from
            if rs.origin == "latest":
                choice = choose_restore(store, "latest", allow_empty=True, known_committed=known)
                return choice, store, url, opts, f"restart {self._attempt}: the root holds no checkpoint"
            choice = choose_restore(store, "latest", allow_empty=True, allow_none_usable=True,
                                    known_committed=known, min_id=rs.run_first_id) if store is not None else None
            if choice is not None and choice.checkpoint_id is not None:
                return choice, store, url, opts, ""
            if rs.origin_id is not None:
                o_store = store if rs.origin_url == url else SnapshotStore.open(rs.origin_url, rs.origin_options)
                again = choose_restore(o_store, rs.origin_id)
                return (RestoreChoice(again.checkpoint_id, choice.skipped if choice else (), again.url), o_store,
                        rs.origin_url, rs.origin_options, "")
            return choice, store, url, opts, f"restart {self._attempt}: no checkpoint of this run to restore"
        ids = sorted(i for i, why in evidence.items() if not why.startswith("sink "))  # the root's own
        if r is None or r == "fresh":
            if r is None and in_root:
                raise ConfigError(
                    f"job {self.flow.name!r}: storage root {url} already holds checkpoints of this job (latest id "
                    f"{ids[-1]}); starting without restore= would continue their ids and mix two runs; pass "
                    f"restore='latest' to continue from them, another storage root, or restore='fresh' to start "
                    "from empty state on purpose (new checkpoint ids continue above the existing ones)"
                )
            rs.origin = "fresh"
            why = (f"restore='fresh': {url} holds checkpoints up to {ids[-1]}, new ones continue above" if r == "fresh"
                   and in_root else ("restore='fresh'" if r else "no restore requested") + f"; {url} holds no checkpoint")
            return None, store, url, opts, why
        if r in ("latest", "latest-if-any"):
            if not in_root:
                if r == "latest":
                    raise NoUsableCheckpointError(
                        f"{url}: holds no checkpoint of job {self.flow.name!r}; restore='latest' has nothing to "
                        "restore; check the storage root, or pass restore='latest-if-any' to restore the latest "
                        "checkpoint when there is one and start fresh otherwise"
                    )
                rs.origin = "fresh"
                return None, store, url, opts, f"restore='latest-if-any': {url} holds no checkpoint"
            choice = choose_restore(store, "latest", known_committed=known)
            rs.origin = "latest"
            return choice, store, url, opts, ""
        if isinstance(r, int):
            choice = choose_restore(store, r)
        else:  # a savepoint (or any root) elsewhere: its latest checkpoint
            store, url, opts = SnapshotStore.open(r, None), r, None
            choice = choose_restore(store, "latest")
        rs.origin, rs.origin_id, rs.origin_url, rs.origin_options = "exact", choice.checkpoint_id, url, opts
        return choice, store, url, opts, ""

    def _plan_output(self, target: int, evidence: dict[int, str], skipped: list, cid: int | None,
                     url: str | None) -> tuple:
        """What to undo of the output committed above ``target`` (see ``restore.plan_output``);
        raises :class:`RepeatedOutputError` when a sink would repeat output and that is not allowed."""
        from ..errors import RepeatedOutputError

        above = {i: why for i, why in evidence.items() if i > target}
        above.update({sk.checkpoint_id: sk.reason for sk in skipped if sk.checkpoint_id > target})
        for i, why in above.items():
            if why == "its manifest exists":
                above[i] = "newer than the checkpoint restored"
        sinks = [SinkView(n.uid, "collect" if isinstance(n.spec["sink"], CollectSink)
                          else "rollback" if n.spec["sink"].supports_rollback else "none", type(n.spec["sink"]).__name__)
                 for n in self.flow.nodes if n.kind == "sink"]
        out = plan_output(target, above, sinks, (c.checkpoint_id for c in self.completed))
        restoring = f"restoring checkpoint {cid} of {url}" if cid is not None else "starting fresh"
        refusal = out.refusal(self.flow.name, restoring)
        if refusal is not None and not self.allow_repeated_output:
            raise RepeatedOutputError(refusal)
        return out, restoring

    def _roll_back_output(self, out: Any, restoring: str) -> None:
        """Carry out :meth:`_plan_output`'s plan: before any worker starts."""
        target = out.target
        rs = self._restore_state
        job = f"[abs] job {self.flow.name!r}"
        for uid, ids in out.repeated.items():
            rs.repeated.setdefault(uid, set()).update(ids)
            print(f"[abs] warning: job {self.flow.name!r}: sink {uid!r} will publish again the output it committed "
                  f"for checkpoint(s) {out.describe(ids)} (allow_repeated_output=True), {restoring}", file=sys.stderr)
        by_uid = {n.uid: n.spec["sink"] for n in self.flow.nodes if n.kind == "sink"}
        for uid in out.rollback:
            done = by_uid[uid].rollback(target)
            if done.checkpoints:
                rs.rolled_back.setdefault(uid, set()).update(done.checkpoints)
                print(f"{job}: sink {uid!r}: rolled back {done.items} {done.unit} committed by checkpoint(s) "
                      f"{id_ranges(done.checkpoints)}, {restoring}", file=sys.stderr)
        for uid, ids in out.drop_collected.items():
            kept = [(b, i) for b, i in zip(self._collected.get(uid, []), self._collected_ids.get(uid, [])) if i <= target]
            dropped = len(self._collected.get(uid, [])) - len(kept)
            self._collected[uid] = [b for b, _ in kept]
            self._collected_ids[uid] = [i for _, i in kept]
            self._staged = {k: v for k, v in self._staged.items() if _collect_key_id(k) <= target}
            rs.rolled_back.setdefault(uid, set()).update(ids)
            print(f"{job}: sink {uid!r}: rolled back {dropped} collected batches of checkpoint(s) {id_ranges(ids)}, "
                  f"{restoring}", file=sys.stderr)

    def _assign_splits(self) -> dict:
        """Fresh start: every split of every source from its initial offset, round robin."""
        out: dict = {}
        for node in self.flow.nodes:
            if node.kind != "source":
                continue
            source = node.spec["source"]
            per_subtask: dict[int, dict] = {s: {} for s in range(self.P)}
            for j, split in enumerate(sorted(source.splits())):
                per_subtask[j % self.P][split] = source.initial_offset(split)
            out[node.uid] = per_subtask
        return out

    def _assignments(self, restore_info: dict) -> list[m.WorkerAssignment]:
        """What each worker owns: its source splits, and on a restore exactly its part of the
        restore plan (its key groups' chains, the sink transactions it re-commits)."""
        plan = restore_info.get("plan")
        if plan is None:
            fresh = self._assign_splits()
            return [m.WorkerAssignment(i, {uid: per_sub.get(i, {}) for uid, per_sub in fresh.items()})
                    for i in range(self.P)]
        sources = restore_info["sources"]
        source_splits = plan.source_assignment(lambda uid, split: sources[uid].initial_offset(split))
        # every keyed operator and state of the checkpoint, with only this worker's chains:
        # a worker without a key group of it still learns that its operator was restored
        names = {uid: tuple(states) for uid, states in restore_info["manifest"].keyed.items()}

        def own(i: int) -> dict:
            chains = plan.keyed_chains(i)
            return {uid: {state: dict(chains.get(uid, {}).get(state, {})) for state in states}
                    for uid, states in names.items()}

        return [m.WorkerAssignment(
            subtask=i,
            source_splits={uid: per_sub.get(i, {}) for uid, per_sub in source_splits.items()},
            keyed_chains=own(i),
            sink_transactions=dict(plan.subtasks[i].sink_transactions) or None,
        ) for i in range(self.P)]

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
                first_id, restore_info = self._open_storage()
                spec = self._spec(restore_info, attempt)
                assignments = self._assignments(restore_info)
                self._open_sources(restore_info, attempt)
                self._launch(spec, assignments, procs, conns)
                self._t_started = time.monotonic()
                self.status = "RUNNING"
                self._loop(procs, conns, first_id)
                self.status = "FINISHED"
                break
            except Exception as exc:
                # anything from opening the root to the last record fails this attempt; the
                # restart strategy retries it unless the error is permanent (abs.runtime.failures)
                if isinstance(exc, _Canceled) or not should_restart(exc):
                    self.status = "CANCELED" if isinstance(exc, _Canceled) else "FAILED"
                    self.error = exc
                    break
                if attempt >= self.restart.max_restarts:
                    self.status, self.error = "FAILED", self._gave_up(exc)
                    break
                attempt += 1
                self._teardown(procs, conns)
                procs, conns = [], {}
                self._prepare_restart(attempt, exc)
            except BaseException as exc:
                self.status, self.error = "FAILED", exc
                break
            finally:
                self._teardown(procs, conns)
                self._close_sources()
                self._gc.drain()  # when run() returns, retention has been applied
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
            _collected=self._collected,
        )
        self._done.set()
        if self.status == "FAILED":
            err = self.error
            if isinstance(err, JobFailedError):
                err.result = self.result
                raise err
            if isinstance(err, (ConfigError, StorageError)) or not isinstance(err, Exception):
                raise err  # type: ignore[misc]
            raise JobFailedError(f"job {self.flow.name!r} failed: {err}", self.result) from err
        return self.result

    def _sources(self) -> list:
        return [(n.uid, n.spec["source"]) for n in self.flow.nodes if n.kind == "source"]

    def _open_sources(self, restore_info: dict, attempt: int) -> None:
        """The driver-side part of every source (see ``Source.driver_open``)."""
        from ..connectors.sources import Source, SourceContext

        manifest = restore_info.get("manifest")
        self._opened_sources = []
        # only sources with a driver side of their own need the stored offsets
        wanted = any(type(src).driver_open is not Source.driver_open for _uid, src in self._sources())
        stored = self._stored_manifests() if wanted else None
        for uid, source in self._sources():
            restored = dict(manifest.source_offsets.get(uid, {})) if manifest is not None else None
            source.driver_open(SourceContext(
                uid=uid, job_name=self.flow.name, parallelism=self.P, storage_url=self.storage_url,
                storage_options=self.storage_options, restored_offsets=restored, attempt=attempt,
                retained=self.config.retained,
                stored_offsets=None if stored is None else tuple(
                    dict(m.source_offsets.get(uid, {})) for m in stored if m.kind != "savepoint"),
                pinned_offsets=() if stored is None else tuple(
                    dict(m.source_offsets.get(uid, {})) for m in stored if m.kind == "savepoint"),
            ))
            self._opened_sources.append(source)

    def _stored_manifests(self) -> list | None:
        """Every readable manifest of the storage root, oldest first (None without storage)."""
        if self.store is None:
            return None
        out = []
        for cid in self.store.list_checkpoints():
            try:
                out.append(self.store.read_manifest(cid))
            except Exception:  # noqa: BLE001 - an unreadable manifest is never restored
                continue
        return out

    def _close_sources(self) -> None:
        for source in getattr(self, "_opened_sources", []):
            try:
                source.driver_close()
            except Exception as exc:  # noqa: BLE001 - closing never hides the job's own outcome
                print(f"[abs] warning: closing source {type(source).__name__} failed: {exc}", file=sys.stderr)
        self._opened_sources = []

    def _driver_fault(self, point: str, procs: list) -> None:
        """Driver-side fault points kill a worker (``Fault.task`` ``"task<t>#<i>"`` names
        worker ``i``; ``"*"`` worker 0) with SIGKILL at the n-th hit."""
        for f in self.faults:
            if f.point != point or f.attempt != self._attempt:
                continue
            self._driver_hits[f] = self._driver_hits.get(f, 0) + 1
            if self._driver_hits[f] == f.nth:
                index = 0 if f.task in ("*", "driver") else int(f.task.split("#")[1])
                procs[index].kill()
                procs[index].wait()

    def _prepare_restart(self, attempt: int, exc: BaseException) -> None:
        """Global failover: every worker is stopped; after the strategy's delay the next attempt
        restores this run's newest checkpoint that can be restored, else what the run started
        from (or starts over), rolling the sinks back to it (see ``_resolve_restore``)."""
        self._gc.drain()  # the restore reads the root as the last GC left it
        delay = self.restart.delay_before(attempt)
        first_line = self._summary(exc)
        print(f"[abs] job {self.flow.name!r}: {first_line}; restart {attempt} of "
              f"{self.restart.max_restarts} in {delay:.1f} s from the latest complete checkpoint", file=sys.stderr)
        time.sleep(delay)
        self.restarts.append({
            "attempt": attempt,
            "error": first_line,
            "at": time.monotonic() - self.t_start,
            "restored_from": None,  # filled in once the restore is resolved
        })
        self.restored_from = None
        self._records = {}
        self._manifests = {}
        self._bases = {}
        self._last_completed_id = 0
        self.status = "RESTARTING"

    def _summary(self, exc: BaseException) -> str:
        """One line for the restart log and ``JobResult.restarts``: the first line of the error
        (it names the worker or operator), then its last one (the cause, e.g. the last line of
        a remote traceback) when the first does not hold it already; without the job's own
        ``job 'name': `` prefix, which the log line puts in front once."""
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        if not lines:
            return type(exc).__name__
        first = lines[0].removeprefix(f"job {self.flow.name!r}: ")
        if not isinstance(exc, JobFailedError):
            first = f"{type(exc).__name__}: {first}"  # e.g. a storage error while opening the root
        if len(lines) > 1 and lines[-1].split(": ", 1)[-1] not in first:
            first += f" {lines[-1]}"
        return first

    def _gave_up(self, exc: Exception) -> Exception:
        """The error of a job that has no restart left: our own errors now advise the restore
        (while restarts are left, the job restores itself and the advice would mislead)."""
        if isinstance(exc, JobFailedError) and self.checkpointing:
            used = len(self.restarts)
            sep = "\n" if "\n" in str(exc) else "; "
            exc.args = (f"{exc}{sep}the job gave up after {used} restart(s) (RestartStrategy.max_restarts="
                        f"{self.restart.max_restarts}); run it again with restore='latest' to continue from its "
                        "latest complete checkpoint",) + exc.args[1:]
        return exc

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
        total: dict[str, int] = {}
        for per_worker in self._records.values():
            for uid, n in per_worker.items():
                total[uid] = total.get(uid, 0) + n
        return total

    def _launch(self, spec: WorkerSpec, assignments: list, procs: list, conns: dict[int, Any]) -> None:
        """Start the workers and take them through the start-up handshake to the running
        state. Fills ``procs`` and ``conns`` as it goes, so that the caller tears down every
        worker started when any step fails: a failure here is a failure of the attempt,
        retried by the restart strategy like any other."""
        import cloudpickle

        secret = secrets.token_bytes(32)
        host = self.executor.driver_host() if hasattr(self.executor, "driver_host") else "127.0.0.1"
        listener = Listener((host, 0), authkey=secret)
        try:
            boots = [{"driver": list(listener.address), "secret": secret.hex(), "index": i} for i in range(self.P)]
            if hasattr(self.executor, "launch_all"):  # e.g. a Spark barrier stage: all workers at once
                procs.extend(self.executor.launch_all(boots, self.flow.name))
            else:
                for i, boot in enumerate(boots):
                    procs.append(self.executor.launch(i, boot))
            accepted: list = []
            acceptor = threading.Thread(target=lambda: [accepted.append(listener.accept()) for _ in range(self.P)], daemon=True)
            acceptor.start()
            deadline = time.monotonic() + self.startup_timeout
            while acceptor.is_alive() and time.monotonic() < deadline:
                acceptor.join(0.1)
                self._check_procs(procs, conns)
            if len(accepted) < self.P:
                raise WorkerLostError(f"only {len(accepted)} of {self.P} workers connected within {self.startup_timeout:.0f} s")
            for c in accepted:
                hello = c.recv()
                if not isinstance(hello, m.Hello):
                    raise m.unexpected(hello, f"job {self.flow.name!r}: the driver", "a worker", "Hello")
                conns[hello.index] = c
                if hasattr(procs[hello.index], "bind_pid"):
                    procs[hello.index].bind_pid(hello.pid)
            payload = cloudpickle.dumps(spec)
            for i, c in conns.items():
                c.send(m.JobSpec(payload, assignments[i]))
            listening = self._gather(conns, m.Listening, procs)
            addresses = tuple(listening[i].address for i in range(self.P))
            for c in conns.values():
                c.send(m.Peers(addresses))
            for i, ready in self._gather(conns, m.Ready, procs).items():
                self._bytes_restored[i] = ready.stats.bytes_restored
                self._restore_seconds[i] = ready.stats.restore_seconds
                self.restored_key_groups[i] = ready.stats.key_groups
            for c in conns.values():
                c.send(m.Start())
        finally:
            listener.close()
            self._drop_probe()
        return procs, conns

    def _drop_probe(self) -> None:
        token, self._probe = self._probe, None
        if token is not None and self.store is not None:
            try:
                self.store.delete_probe(token)
            except StorageError as exc:  # a leftover probe is harmless (GC leaves it alone)
                print(f"[abs] warning: could not delete the storage probe: {exc}", file=sys.stderr)

    def _gather(self, conns: dict[int, Any], kind: type, procs: list) -> dict[int, Any]:
        """The ``kind`` message of every worker (in any order); a worker that reports a
        failure, dies or closes its connection first fails the attempt with the cause."""
        pending = dict(conns)
        got: dict[int, Any] = {}
        deadline = time.monotonic() + self.startup_timeout
        last_seen = {i: time.monotonic() for i in pending}  # starting workers send heartbeats
        while pending:
            now = time.monotonic()
            if now > deadline:
                raise WorkerLostError(
                    f"job {self.flow.name!r}: worker(s) {sorted(pending)} did not report {kind.__name__} within "
                    f"{self.startup_timeout:.0f} s"
                )
            silent = [i for i in pending if now - last_seen[i] > self.heartbeat_timeout]
            if silent:
                raise WorkerLostError(
                    f"job {self.flow.name!r}: worker {silent[0]} sent nothing for {now - last_seen[silent[0]]:.0f} s "
                    f"while starting (waiting for {kind.__name__}; heartbeat timeout); it is hung or overloaded"
                )
            for conn in wait(list(pending.values()), timeout=0.1):
                i = next(k for k, c in pending.items() if c is conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    self._settle(procs, conns)
                    raise WorkerLostError(
                        f"job {self.flow.name!r}: worker {i} closed its connection while starting (waiting for {kind.__name__})"
                    ) from None
                last_seen[i] = time.monotonic()
                if isinstance(msg, kind):
                    got[i] = msg
                    del pending[i]
                elif isinstance(msg, m.TaskFailed):
                    self._startup_failed(i, msg, procs, conns)
                elif isinstance(msg, (m.Heartbeat, m.CollectCommit, m.Metrics)):
                    pass  # alive; a restored CollectSink re-commits what this driver committed with the manifest
                else:
                    raise m.unexpected(msg, f"job {self.flow.name!r}: the driver", f"worker {i}", kind.__name__)
            self._settle(procs, conns, wait_s=0.0)
        return got

    def _settle(self, procs: list, conns: dict, wait_s: float = 0.5) -> None:
        """While starting: a worker that died fails the attempt, with the failure it reported
        when it reported one (it exits after reporting), else as a lost worker. ``wait_s``
        lets exit statuses arrive: a worker's failure is often collateral (its peer died)."""
        until = time.monotonic() + wait_s
        while True:
            for i, p in enumerate(procs):
                code = p.poll()
                if code is None or code == 0:
                    continue
                conn = conns.get(i)
                try:
                    reported = conn.recv() if conn is not None and code > 0 and conn.poll(0.2) else None
                except (EOFError, OSError):
                    reported = None
                if isinstance(reported, m.TaskFailed):
                    self._startup_failed(i, reported, procs, conns, settle=False)
                self._check_procs(procs, conns)
            if time.monotonic() >= until:
                return
            time.sleep(0.05)

    def _startup_failed(self, i: int, msg: m.TaskFailed, procs: list, conns: dict, settle: bool = True) -> None:
        """Raise the :class:`StartupError` of worker ``i``'s :class:`TaskFailed` report; first,
        a peer that was killed (the usual cause of a failure to connect) fails it instead."""
        phase = msg.phase or "starting"
        cause = msg.cause or (msg.traceback.strip().splitlines() or ["?"])[-1]
        deadline = time.monotonic() + (0.5 if settle else 0.0)
        while settle:
            for k, p in enumerate(procs):
                code = p.poll()
                if k != i and code is not None and code < 0:
                    raise WorkerLostError(
                        f"job {self.flow.name!r}: worker {k} (pid {p.pid}) was killed by signal {-code} while the "
                        f"workers started; worker {i} failed with it while {phase}: {cause}"
                    )
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        raise StartupError(
            f"job {self.flow.name!r}: worker {i} failed while {phase}: {cause}\n{msg.traceback}",
            permanent=msg.permanent,
        )

    def _check_procs(self, procs: list, conns: dict) -> None:
        for i, p in enumerate(procs):
            code = p.poll()
            if code is not None and code != 0:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                raise WorkerLostError(
                    f"job {self.flow.name!r}: worker {i} (pid {p.pid}) {how}; no checkpoint after the last "
                    "complete one is used"
                )

    # ------------------------------------------------------------------ main loop
    def _loop(self, procs: list, conns: dict, first_id: int) -> None:
        expected = self.plan.task_keys(self.P)
        source_keys = {k for k in expected if self.plan.tasks[int(k[4:].split("#")[0])].is_source}
        coord = CheckpointCoordinator(self.config, expected, first_id, clock=time.monotonic)
        self.coord = coord
        exhausted: set[str] = set()
        done_tasks: set[str] = set()
        final_from: int | None = None  # first checkpoint id triggered after every source was exhausted
        finishing = False
        last_seen = {i: time.monotonic() for i in conns}
        trigger_times: dict[int, float] = {}
        finals_requested = 0
        by_conn = {id(c): i for i, c in conns.items()}

        def broadcast(msg: Any) -> None:
            for c in conns.values():
                try:
                    c.send(msg)
                except OSError:
                    pass

        def handle(actions: list) -> None:
            nonlocal final_from, finishing
            for a in actions:
                if isinstance(a, Trigger):
                    trigger_times[a.checkpoint_id] = time.monotonic()
                    if final_from is None and len(exhausted) == len(source_keys):
                        final_from = a.checkpoint_id
                    base = self._last_completed_id
                    self._bases[a.checkpoint_id] = base
                    broadcast(m.TriggerCheckpoint(a.checkpoint_id, base))
                elif isinstance(a, FailJob):
                    raise CheckpointFailedError(
                        f"job {self.flow.name!r}: {a.reason}; raise CheckpointConfig.tolerable_failures or fix the cause"
                    )
                elif isinstance(a, Abort):
                    self.failed.append((a.checkpoint_id, a.reason))
                    broadcast(m.CheckpointAborted(a.checkpoint_id, a.reason))
                    if self.config.mode == "stop_the_world":
                        broadcast(m.Resume(a.checkpoint_id))
                    self._notify_waiter(a.checkpoint_id, JobFailedError(f"checkpoint {a.checkpoint_id} failed: {a.reason}"))
                    if final_from is not None and a.checkpoint_id >= final_from:
                        final_from = None  # retry the final checkpoint
                elif isinstance(a, Commit):
                    try:
                        self._driver_fault("before_commit", procs)
                        self._commit(a, trigger_times.get(a.checkpoint_id, a.started_at))
                        self._driver_fault("after_commit", procs)
                    except Exception as exc:  # noqa: BLE001 - a failed commit fails the checkpoint only
                        handle(coord.on_commit_failed(a.checkpoint_id, f"{type(exc).__name__}: {exc}"))
                        continue
                    handle(coord.on_committed(a.checkpoint_id))
                elif isinstance(a, NotifyComplete):
                    broadcast(m.CheckpointCompleted(a.checkpoint_id))
                    if self.config.mode == "stop_the_world":
                        broadcast(m.Resume(a.checkpoint_id))
                    self._notify_waiter(a.checkpoint_id, a.checkpoint_id)
                    if final_from is not None and a.checkpoint_id >= final_from and not finishing:
                        finishing = True
                        broadcast(m.Finish())

        while True:
            self._check_procs(procs, conns)
            for conn in wait(list(conns.values()), timeout=0.02):
                i = by_conn[id(conn)]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    self._check_procs(procs, conns)
                    time.sleep(0.2)
                    self._check_procs(procs, conns)
                    raise WorkerLostError(f"job {self.flow.name!r}: lost the connection to worker {i}")
                last_seen[i] = time.monotonic()
                if isinstance(msg, m.Ack):
                    handle(coord.on_ack(msg.checkpoint_id, msg.task, msg.ack))
                elif isinstance(msg, m.Decline):
                    actions = coord.on_decline(msg.checkpoint_id, msg.task, msg.reason)
                    if not actions:
                        self._late_decline(msg.checkpoint_id, msg.task, msg.reason)
                    handle(actions)
                elif isinstance(msg, (m.Collect, m.CollectCommit)):
                    self._on_collect(msg)
                elif isinstance(msg, m.Metrics):
                    self._records[msg.index] = msg.metrics.records_in
                elif isinstance(msg, m.SourceExhausted):
                    exhausted.add(msg.task)
                    if len(exhausted) == len(source_keys):
                        self._t_exhausted = time.monotonic()
                elif isinstance(msg, m.TaskDone):
                    done_tasks.add(msg.task)
                    coord.on_task_finished(msg.task)
                elif isinstance(msg, m.Heartbeat):
                    pass  # a starting worker's (see worker.main); a running one sends Metrics
                elif isinstance(msg, m.TaskFailed):
                    # a task often fails only because a peer worker died (its channel broke):
                    # name the dead worker, not the collateral failure
                    deadline = time.monotonic() + 0.5
                    while time.monotonic() < deadline:
                        self._check_procs(procs, conns)
                        time.sleep(0.05)
                    handle(coord.on_task_failed(msg.task))
                    raise OperatorError(
                        f"job {self.flow.name!r}: operator {msg.uid!r} failed in {msg.task} (worker {i}):\n{msg.traceback}"
                    )
                else:
                    raise m.unexpected(msg, f"job {self.flow.name!r}: the driver", f"worker {i}")
            now = time.monotonic()
            for i, seen in last_seen.items():
                if now - seen > self.heartbeat_timeout:
                    raise WorkerLostError(
                        f"job {self.flow.name!r}: worker {i} sent nothing for {now - seen:.0f} s (heartbeat timeout); "
                        "it is hung or overloaded"
                    )
            self._serve_requests(coord, handle, broadcast)
            if len(done_tasks) == len(expected):
                broadcast(m.Shutdown())
                self._collect_done(conns, procs)
                return
            if finishing:
                continue
            if len(exhausted) == len(source_keys):
                if not self.checkpointing:
                    finishing = True
                    broadcast(m.Finish())
                    continue
                if final_from is None and not coord.pending_ids():
                    finals_requested += 1
                    if finals_requested > 5:
                        raise CheckpointFailedError(
                            f"job {self.flow.name!r}: the final checkpoint failed 5 times "
                            f"(last: {self.failed[-1][1] if self.failed else '?'}); output since the last complete "
                            "checkpoint is not committed"
                        )
                    coord.request()
            handle(coord.tick())

    def _late_decline(self, cid: int, task: str, reason: str) -> None:
        """A decline for a checkpoint that has already failed (e.g. its timeout fired while a
        task's snapshot writer hung): its reason joins the failure's, so that
        ``JobResult.failed_checkpoints`` names the cause, not only the timeout."""
        for k, (failed_id, why) in enumerate(self.failed):
            if failed_id == cid and reason not in why:
                self.failed[k] = (cid, f"{why}; then declined by {task}: {reason}")
                return

    def _serve_requests(self, coord: Any, handle: Any, broadcast: Any) -> None:
        while True:
            try:
                req = self.requests.get_nowait()
            except queue.Empty:
                return
            if isinstance(req, m.CancelRequest):
                broadcast(m.Stop())
                raise _Canceled()
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
            handle(coord.tick())

    def _notify_waiter(self, cid: int, value: Any) -> None:
        q = self._waiters.pop(cid, None)
        if q is not None:
            q.put(value)

    def _commit(self, a: Any, triggered: float) -> None:
        from storage import Lineage, Manifest

        keyed: dict = {}
        offsets: dict = {}
        sinks: dict = {}
        align = sync = asyn = async_cpu = 0.0
        written = files = 0
        for task, ack in a.acks.items():
            for uid, states in ack.keyed.items():
                for state, by_kg in states.items():
                    keyed.setdefault(uid, {}).setdefault(state, {}).update(by_kg)
            for uid, offs in ack.source_offsets.items():
                offsets.setdefault(uid, {}).update(offs)
            for uid, by_sub in ack.sink_transactions.items():
                sinks.setdefault(uid, {}).update(by_sub)
            align = max(align, ack.alignment_time)
            sync = max(sync, ack.sync_time)
            asyn = max(asyn, ack.async_time)
            async_cpu += ack.async_cpu
            written += ack.bytes_written
            files += ack.files_written
        now = time.monotonic()
        manifest = Manifest(
            checkpoint_id=a.checkpoint_id,
            job_name=self.flow.name,
            max_parallelism=self.flow.max_parallelism,
            keyed=keyed,
            source_offsets=offsets,
            sink_transactions=sinks,
            stats={
                "duration_s": now - triggered,
                "alignment_s": align,
                "sync_s": sync,
                "async_s": asyn,
                "async_cpu_s": async_cpu,
                "parallelism": self.P,
                "mode": self.config.mode,
            },
            lineage=Lineage.following(self.run_id, self._follows),
        )
        stored = self.store.commit(manifest)
        self._follows = stored
        self._manifests[a.checkpoint_id] = stored
        self._last_completed_id = a.checkpoint_id
        if self._record_commits:  # before any sink hears of it (see abs.runtime.restore)
            try:
                self.store.record_committed(a.checkpoint_id)
            except Exception as exc:  # noqa: BLE001 - the checkpoint is complete either way
                print(f"[abs] warning: checkpoint {a.checkpoint_id}: writing the commit record failed ({exc}); "
                      "a restore could miss that its output exists if its manifest is lost", file=sys.stderr)
        # CollectSink epochs staged in this driver become visible with the manifest, not when
        # the workers hear of it: a job canceled (or lost) right after the commit keeps them,
        # and a restore in another process, which cannot re-commit them, starts after them
        for uid in self._collect_sinks:
            for txns in sinks.get(uid, {}).values():
                self._on_collect(m.CollectCommit(tuple(txns or ())))
        self.store_gc()
        for uid, source in self._sources():
            try:
                source.driver_checkpoint_complete(a.checkpoint_id, offsets.get(uid, {}))
            except Exception as exc:  # noqa: BLE001 - the checkpoint is complete either way
                print(f"[abs] warning: source {uid!r}: checkpoint {a.checkpoint_id} completion hook failed: {exc}",
                      file=sys.stderr)
        full = sum(r.bytes for r in manifest.files().values())
        self.completed.append(
            CheckpointStats(
                a.checkpoint_id, triggered - self.t_start, now - triggered, align, sync, asyn, written, full, files,
                async_cpu,
            )
        )

    def store_gc(self) -> None:
        """Retention: keep the last ``retained`` checkpoints, plus every file that an in-flight
        checkpoint may build on (the files of its base checkpoint, see ``Barrier.base``). The
        plan is made as of the checkpoint just committed and carried out in the background."""
        in_flight: list = []
        # the checkpoint just committed is still pending in the coordinator, but its manifest
        # now names every file it needs: its base is not live on its account
        live_bases = {self._bases[m] for m in self.coord.pending_ids() if m in self._bases and m != self._last_completed_id}
        for cid in list(self._manifests):
            if cid in live_bases:
                in_flight.extend(self._manifests[cid].files().values())
            elif cid != self._last_completed_id:
                del self._manifests[cid]  # no pending checkpoint builds on it any more
        request = GcRequest(self.store, self.config.retained, tuple(in_flight), self._last_completed_id)
        if str(self.storage_url).startswith("memory://"):
            self._gc.run_now(request)  # see BackgroundGc.run_now
        else:
            self._gc.submit(request)

    def _on_collect(self, msg: "m.Collect | m.CollectCommit") -> None:
        """CollectSink's two-phase commit (see ``operators._CollectWriter``): staged epochs
        survive restarts; a commit makes an epoch visible once."""
        if isinstance(msg, m.Collect):
            self._staged[msg.key] = (msg.uid, msg.batches)
            return
        for key in msg.keys:
            staged = self._staged.pop(key, None)
            if staged is not None:
                self._collected.setdefault(staged[0], []).extend(staged[1])
                self._collected_ids.setdefault(staged[0], []).extend([_collect_key_id(key)] * len(staged[1]))

    def _collect_done(self, conns: dict, procs: list) -> None:
        pending = set(conns)
        deadline = time.monotonic() + 60
        while pending and time.monotonic() < deadline:
            for conn in wait([conns[i] for i in pending], timeout=0.1):
                i = next(k for k, c in conns.items() if c is conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    pending.discard(i)
                    continue
                if isinstance(msg, m.Done):
                    self._records[msg.index] = msg.metrics.records_in
                    pending.discard(i)
                elif isinstance(msg, (m.Collect, m.CollectCommit)):
                    self._on_collect(msg)

    def _teardown(self, procs: list, conns: dict) -> None:
        for c in conns.values():
            try:
                c.send(m.Stop())
            except OSError:
                pass
        deadline = time.monotonic() + 5
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for c in conns.values():
            try:
                c.close()
            except OSError:
                pass


class _Canceled(Exception):
    pass


@dataclasses.dataclass
class _RestoreState:
    """What the driver remembers across the attempts of one run (see ``_resolve_restore``)."""

    started: bool = False
    run_first_id: int = 1  # the first checkpoint id of this run: restarts prefer ids >= it
    origin: str = "fresh"  # what the run started from: "fresh", "latest" or "exact"
    origin_id: int | None = None
    origin_url: str | None = None
    origin_options: dict | None = None
    skipped: list = dataclasses.field(default_factory=list)
    rolled_back: dict = dataclasses.field(default_factory=dict)
    repeated: dict = dataclasses.field(default_factory=dict)


def _collect_key_id(key: str) -> int:
    """The checkpoint id a CollectSink transaction key ends with (``uid/subtask/tag/id``)."""
    try:
        return int(str(key).rsplit("/", 1)[1])
    except (IndexError, ValueError):
        return 0
