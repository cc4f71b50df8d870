"""A worker: hosts subtask ``i`` of every task of the job (its process starts in
:mod:`abs.runtime.worker_main`).

The start-up handshake with the driver and the messages that follow it are the typed
messages of :mod:`abs.runtime.messages`.
"""
from __future__ import annotations

import logging
import dataclasses
import os
import queue
import socket
import threading
import time
import traceback
from multiprocessing.connection import Listener
from typing import Any

import numpy as np
import pyarrow as pa

from abscore.gcpause import gc_paused
from storage.session import with_written

from ..dataflow import Dataflow
from ..keygroups import KeyGroupSet, key_group_range
from ..state import ColumnDelta, PickledDelta
from ..reconfig.transfer import pack
from .installer import Installer
from .channels import InputGate
from .operators import KeyedOp, OpSnapshot, build_operator
from .plan import PhysicalPlan, compile_plan, task_key
from ..faults import WORKER_POINTS, trip
from . import messages as m
from .exchange import ExchangeWriter
from .task import Task
from .connections import WorkerChannels
from .loops import FeedbackLogs, replay_batches, write_log
from .writer import InThreadWriter, SnapshotWriter, WriteFailedError, WriterHungError, writes_in_process

log = logging.getLogger(__name__)

__all__ = ["Worker", "WorkerSpec"]

# key groups a restore reads at once (KeyedOp.restore): from local disk decompressing is the
# work (two threads), from an object store waiting on requests
RESTORE_READERS = 2
RESTORE_READERS_REMOTE = 8


@dataclasses.dataclass
class WorkerSpec:
    """Everything a worker needs, shipped by the driver (cloudpickled)."""

    flow: Dataflow
    parallelism: int
    routing: tuple[int, ...]
    checkpointing: bool
    checkpoint_mode: str
    storage_url: str | None
    storage_options: dict | None
    restore_url: str | None = None
    restore_storage_options: dict | None = None
    channel_capacity: int = 8
    faults: tuple = ()  # abs.faults.Fault of this attempt
    writer_timeout: float | None = None  # seconds the uploader waits on the writer process for one write
    storage_probe: str | None = None  # token of the driver's probe file (storage.SnapshotStore.write_probe)
    alignment_timeout: float | None = None  # CheckpointConfig.alignment_timeout

    @property
    def priority_barriers(self) -> bool:
        """Senders announce barriers ahead of queued records (abs.runtime.unaligned)."""
        return self.checkpoint_mode == "unaligned" or self.alignment_timeout is not None


class _Fault(Exception):
    pass


class Worker(WorkerChannels):
    def __init__(self, index: int, conn: Any, spec: WorkerSpec, secret: bytes,
                 assignment: m.WorkerAssignment | None = None) -> None:
        self.index = index
        self.conn = conn
        self.spec = spec
        # what this worker owns, from the driver's restore plan (or fresh split assignment)
        self.assignment = assignment if assignment is not None else m.WorkerAssignment(index, {})
        self.secret = secret
        self.bind_host = "127.0.0.1"
        self.plan: PhysicalPlan = compile_plan(spec.flow)
        self.checkpointing = spec.checkpointing
        self.checkpoint_mode = spec.checkpoint_mode
        self._send_lock = threading.Lock()
        self._uploads: "queue.Queue[Any]" = queue.Queue()
        self.tasks: dict[int, Task] = {}
        self.gates: dict[int, InputGate] = {}
        self.store = None
        self.writer: SnapshotWriter | None = None
        self._in_thread: InThreadWriter | None = None  # writes where there is no writer process
        self._fault_counts: dict[tuple, int] = {}
        self.bytes_restored = 0
        self.restore_seconds = 0.0
        self.bytes_written = 0
        self._stopped = threading.Event()
        self.installer: Installer | None = None  # live reconfiguration: started by run()

    # ------------------------------------------------------------------ messaging
    def send_to_driver(self, msg: Any) -> None:
        with self._send_lock:
            try:
                self.conn.send(msg)
            except (OSError, EOFError):
                self._stopped.set()

    def task_finished(self, task: Task) -> None:
        self.send_to_driver(m.TaskDone(task.key))

    def task_failed(self, task: Task, uid: str, tb: str) -> None:
        self.send_to_driver(m.TaskFailed(task.key, uid, tb))

    def source_exhausted(self, task: Task) -> None:
        self.send_to_driver(m.SourceExhausted(task.key, task.splits_gained))

    def decline(self, task: Task, checkpoint_id: int, reason: str) -> None:
        self.send_to_driver(m.Decline(checkpoint_id, task.key, reason))

    # ------------------------------------------------------------------ reconfiguration
    def hand_over(self, task: Task, step: int, operator: str, kg: int, target: int, tables: dict, chains: dict) -> None:
        """Key group ``kg`` left ``task``: its state goes to the driver, which relays it to the
        new owner (abs.reconfig)."""
        msg = m.KeyGroupHandover(step, operator, kg, self.index, target, pack(tables), chains)
        self.fault("during_transfer", task)
        self.send_to_driver(msg)

    def installed(self, task: Task, install: m.InstallState) -> None:
        self.send_to_driver(m.KeyGroupInstalled(install.step, install.operator, install.key_group, self.index,
                                                install.read_bytes))

    def fault(self, point: str, task: Any, records: int = 0) -> None:
        """Failure injection: crash or hang this process at the n-th hit of ``point`` (of a
        ``records`` fault: at the ``process`` hit that brings the task's records to n)."""
        if not self.spec.faults:
            return
        key = getattr(task, "key", task)
        for f in self.spec.faults:
            if f.point in WORKER_POINTS:  # "task<t>#<i>" names worker i
                hit = f.point == point and (f.task == "*" or f.task.endswith(f"#{self.index}"))
            elif f.point == "records":
                hit = point == "process" and f.task in ("*", key)
            else:
                hit = f.point == point and f.task in ("*", key)
            if hit:
                before = self._fault_counts.get(f, 0)
                self._fault_counts[f] = now = before + (records if f.point == "records" else 1)
                if before < f.nth <= now:
                    trip(f)

    # ------------------------------------------------------------------ snapshots
    def upload_later(self, job: m.UploadJob) -> None:
        self._uploads.put(job)

    def upload_now(self, job: m.UploadJob) -> None:
        self._upload(job)

    def _uploader(self) -> None:
        while True:
            job = self._uploads.get()
            if job is None:
                return
            self._upload(job)

    def _upload(self, job: m.UploadJob) -> None:
        checkpoint_id, task, pieces = job.checkpoint_id, job.task, job.pieces
        started = time.monotonic()
        t0 = time.perf_counter()
        cpu0 = time.thread_time()
        try:
            ack = self._write(checkpoint_id, task, pieces)
        except WriterHungError as exc:
            # killed (see SnapshotWriter.write): this checkpoint is declined, later ones are
            # written in this thread, as after a writer that died. Nothing the killed writer
            # wrote is named by a manifest (the checkpoint never completes), so it is garbage
            # for GC, and the next checkpoint's deltas are taken against the last complete one.
            reason = (f"worker {self.index}'s snapshot writer hung: {exc}; the worker writes its snapshots in its "
                      "own thread from now on")
            log.warning(f"{reason}")
            self.decline(task, checkpoint_id, reason)
            return
        except WriteFailedError as exc:  # the writer process's reason names its error already
            self.decline(task, checkpoint_id, f"upload failed: {exc}")
            return
        except Exception as exc:  # noqa: BLE001 - a failed upload declines the checkpoint
            self.decline(task, checkpoint_id, f"upload failed: {type(exc).__name__}: {exc}")
            return
        ack = dataclasses.replace(
            ack, alignment_time=job.alignment_time, sync_time=job.sync_time, async_time=time.perf_counter() - t0,
            async_cpu=ack.async_cpu + time.thread_time() - cpu0,  # plus the writer process's, counted in _write
            times=(job.snapshot_at, started, time.monotonic()),
        )
        self.fault("before_ack", task)
        self.send_to_driver(m.Ack(checkpoint_id, task.key, ack))

    def discard_writer(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def _write(self, checkpoint_id: int, task: Task, pieces: list[OpSnapshot]) -> m.TaskAck:
        store = self.store
        if self.writer is not None and not self.writer.alive:
            self.discard_writer()  # it died: write in this thread from now on
        keyed: dict = {}
        offsets: dict = {}
        sinks: dict = {}
        written = 0
        paths: set[str] = set()
        writer = self.writer
        in_thread = writer is None
        if writer is None:
            if self._in_thread is None:
                self._in_thread = InThreadWriter(store)
            writer = self._in_thread
        jobs: list[m.WriteJob] = []
        finished: list[OpSnapshot] = []  # pieces whose chains this checkpoint writes
        logs: list = []
        loop_records = None
        channel_records = 0
        for piece in pieces:
            batches = piece.channel_log if piece.channel_log is not None else piece.channel_state
            if batches is not None:  # channel state: a loop head's log or what an unaligned barrier overtook
                rows = sum(b.num_rows for b in batches)
                if piece.channel_log is not None:
                    loop_records = (loop_records or 0) + rows
                else:
                    channel_records += rows
                ref = write_log(store, checkpoint_id, f"{piece.uid}#{task.subtask}", batches)
                if ref is not None:
                    self.fault("during_log_upload", task)
                    logs.append(ref)
                    written += ref.bytes
                    paths.add(ref.path)
                continue
            if piece.source_offsets is not None:
                offsets[piece.uid] = piece.source_offsets
            if piece.sink_transactions is not None:
                sinks[piece.uid] = piece.sink_transactions
            if not piece.prev_chains and not piece.deltas:
                continue
            with gc_paused():  # a job per key group: objects by the thousand, none of them garbage
                for state, by_kg in piece.deltas.items():
                    prev_all = piece.prev_chains.get(state, {})
                    for kg, delta in by_kg.items():
                        complete = False
                        if not (in_thread or isinstance(delta, (ColumnDelta, PickledDelta, pa.Table))):
                            # captured by reference in the synchronous part: encoded here, and the
                            # writer process gets the table
                            lazy = delta
                            delta = lazy.to_table()
                            complete = getattr(lazy, "complete", False)
                        jobs.append(m.WriteJob(piece.uid, state, kg, prev_all.get(kg, []), delta, complete))
            finished.append(piece)
        writer_cpu = 0.0
        new_chains: list = []
        if jobs:
            if in_thread:
                new_chains = writer.write(checkpoint_id, jobs)
            else:
                new_chains = writer.write(checkpoint_id, jobs, timeout=self.spec.writer_timeout)
            writer_cpu = writer.last_cpu
        by_uid: dict[str, list] = {}  # operator -> (state, key group, its new chain)
        with gc_paused():  # the new chains: a list per key group
            for job, new_chain in zip(jobs, new_chains):
                fresh = [r for r in new_chain if r.checkpoint_id == checkpoint_id]
                written += sum(r.bytes for r in fresh)
                paths.update(r.path for r in fresh)
                self.fault("during_upload", task)
                by_uid.setdefault(job.operator, []).append((job.state, job.key_group, new_chain))
            for piece in finished:
                chains = with_written(piece.prev_chains, by_uid.get(piece.uid, ()))
                for state in piece.deltas:
                    chains.setdefault(state, {})  # a captured state is named even with no key group left
                if piece.on_chains is not None:
                    piece.on_chains(checkpoint_id, chains)
                keyed[piece.uid] = chains
        self.bytes_written += written
        return m.TaskAck(
            keyed=keyed,
            source_offsets=offsets,
            sink_transactions={uid: {str(task.subtask): t} for uid, t in sinks.items()},
            bytes_written=written,
            files_written=len(paths),
            async_cpu=writer_cpu,
            channel_logs=tuple(logs),
            loop_records=loop_records,
            channel_records=channel_records,
        )

    # ------------------------------------------------------------------ set-up
    def build(self) -> None:
        spec = self.spec
        if spec.storage_url is not None:
            from storage import SnapshotStore

            self.store = SnapshotStore.open(spec.storage_url, spec.storage_options)
            if spec.storage_probe is not None:
                self.store.check_probe(spec.storage_probe, who=f"worker {self.index} (host {socket.gethostname()})")
            if self.writer is not None and writes_in_process(spec.storage_url):
                try:
                    self.writer.open(spec.storage_url, spec.storage_options)
                except Exception:  # noqa: BLE001 - e.g. storage options that do not pickle: write in-thread
                    self.discard_writer()
            else:
                self.discard_writer()
        else:
            self.discard_writer()
        P = spec.parallelism
        for t in self.plan.tasks:
            self.gates[t.index] = InputGate(t.num_channels(P), spec.channel_capacity, t.back_channels(P))
        # every peer connects its channels at once: with the default backlog of 1 the kernel
        # drops their SYNs and each retries after 1, 3, 7, ... 63 s (seen at P = 8 on a busy
        # machine: a channel missed connect()'s 60 s wait)
        self.listener = Listener((self.bind_host, 0), authkey=self.secret, backlog=128)

    def create_tasks(self) -> m.RestoreStats:
        spec, P, i = self.spec, self.spec.parallelism, self.index
        assignment = self.assignment
        flow = spec.flow
        owned = (key_group_range(flow.max_parallelism, P, i) if assignment.key_groups is None
                 else KeyGroupSet(flow.max_parallelism, assignment.key_groups))
        ctx = _OperatorContext(
            subtask=i,
            parallelism=P,
            max_parallelism=flow.max_parallelism,
            key_group_range=owned,
            send_to_driver=self.send_to_driver,
            fault=self.fault,
        )
        routing = np.asarray(spec.routing, dtype=np.int64)
        restore_store = None
        restored_kgs: dict = {}
        if assignment.keyed_chains:
            from storage import SnapshotStore

            restore_store = SnapshotStore.open(spec.restore_url, spec.restore_storage_options)
        for t in self.plan.tasks:
            ops = {}
            for n in t.nodes:
                node = flow.nodes[n]
                restored = (assignment.sink_transactions or {}).get(node.uid, ())
                # each operator owns its key groups apart (a live move hands them over one
                # operator at a time): a set given by the assignment is copied per operator, as
                # a range is when its backend turns it into a set
                op_ctx = (dataclasses.replace(ctx, key_group_range=KeyGroupSet(flow.max_parallelism, owned))
                          if isinstance(owned, KeyGroupSet) else ctx)
                op = build_operator(node, op_ctx, restored)
                op.task_key = task_key(t.index, i)
                if isinstance(op, KeyedOp) and assignment.keyed_chains and node.uid in assignment.keyed_chains:
                    self.fault("restore", f"task{t.index}#{i}")
                    same_root = spec.restore_url == spec.storage_url
                    chains = assignment.keyed_chains[node.uid]
                    t0 = time.perf_counter()
                    # counted per key group read: the start-up heartbeats carry the figure
                    op.restore(chains, restore_store.read_chain, same_root, on_read=self._restored,
                               readers=RESTORE_READERS_REMOTE if restore_store.object_store else RESTORE_READERS,
                               read_range=restore_store.read_range)
                    self.restore_seconds += time.perf_counter() - t0
                    restored_kgs[node.uid] = {state: tuple(sorted(by_kg)) for state, by_kg in chains.items()}
                ops[n] = op
            for n, op in ops.items():
                op.outputs = [ops[c].process for c in t.children.get(n, ())]
            writers = []
            for out in t.outputs:
                key = (t.index, out.from_node, out.target_task, out.edge_index)
                w = ExchangeWriter(out, self.senders[key], routing, flow.max_parallelism,
                                   flow.nodes[out.target_node].uid, self.joining[key])
                ops[out.from_node].outputs.append(w)
                writers.append(w)
            reader = None
            head = flow.nodes[t.head]
            if head.kind == "source":
                splits = assignment.source_splits.get(head.uid, {})
                reader = head.spec["source"].create_reader(splits, i, P)
            task = self.tasks[t.index] = Task(t, i, ops, self.gates[t.index], writers, self, reader)
            if t.back_edges:  # an iteration head: its feedback channels
                task.loop = FeedbackLogs(t.back_channels(P))
            logs = [r for r in assignment.channel_logs if r.location().task.rpartition("#")[0] == head.uid]
            if logs:  # channel state of the restored checkpoint: replayed before any input
                from storage import SnapshotStore

                store = restore_store or SnapshotStore.open(spec.restore_url, spec.restore_storage_options)
                task.replay = replay_batches(store, logs, ops[t.head], i, P)
        return m.RestoreStats(self.bytes_restored, self.restore_seconds, restored_kgs)

    def _restored(self, nbytes: int) -> None:
        self.bytes_restored += nbytes

    # ------------------------------------------------------------------ control loop
    def run(self) -> None:
        uploader = threading.Thread(target=self._uploader, name="uploader", daemon=True)
        uploader.start()
        self.installer = Installer(self.index, self.store, lambda: list(self.tasks.values()), self.send_to_driver)
        self.installer.start()
        for task in self.tasks.values():
            task.start()
        threading.Thread(target=self._metrics_loop, daemon=True).start()
        while not self._stopped.is_set():
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                os._exit(3)  # the driver is gone: nothing to report to
            try:
                if not self.on_control(msg):
                    break
            except m.ProtocolError:
                self.send_to_driver(m.TaskFailed(f"worker{self.index}", "<control>", traceback.format_exc()))
                break
        self._uploads.put(None)
        self.installer.stop()
        uploader.join(timeout=30)
        self.discard_writer()
        self.send_to_driver(m.Done(self.index, self._metrics()))

    def on_control(self, msg: Any) -> bool:
        """Hand one message of the driver to the tasks; False once the worker is to stop.
        An unknown message raises :class:`~abs.runtime.messages.ProtocolError`."""
        match msg:
            case m.Preload() | m.KeyGroupHandover():
                self.installer.put(msg)
            case m.TriggerCheckpoint() | m.Resume() | m.Finish() | m.StartStep():  # for the source tasks
                for task in self.tasks.values():
                    if task.reader is not None:
                        task.gate.put_control(msg)
            case m.SplitsHandover():
                for task in self.tasks.values():
                    if task.reader is not None and task.head.uid == msg.operator:
                        task.gate.put_control(msg)
            case m.AddPeers():
                self.add_peers(msg)
            case m.CheckpointAborted() | m.CheckpointCompleted():
                for task in self.tasks.values():
                    task.gate.put_control(msg)
            case m.Stop():
                for task in self.tasks.values():
                    task.gate.put_control(msg)
                    task.gate.close()
                return False
            case m.Shutdown():
                return False
            case _:
                raise m.unexpected(msg, f"worker {self.index}", "the driver", "a control message")
        return True

    def _metrics(self) -> m.WorkerMetrics:
        records = {}
        emitted = {}
        per_kg = {}
        lags = []
        for task in self.tasks.values():
            for op in task.ops.values():
                records[op.uid] = op.records_in
                emitted[op.uid] = op.records_out
                if isinstance(op, KeyedOp):
                    per_kg[op.uid] = op.kg_records.tolist()
            if task.reader is not None and (lag := task.reader.lag()) is not None:
                lags.append(lag)
        load = {task.key: task.load() for task in self.tasks.values()}
        fill = {task.key: task.gate.fill() for task in self.tasks.values() if task.reader is None}
        return m.WorkerMetrics(records, self.bytes_written, self.bytes_restored, load,
                               sum(lags) if lags else None, per_kg, fill, emitted)

    def _metrics_loop(self) -> None:
        while not self._stopped.wait(0.5):
            self.send_to_driver(m.Metrics(self.index, self._metrics()))


@dataclasses.dataclass
class _OperatorContext:
    subtask: int
    parallelism: int
    max_parallelism: int
    key_group_range: Any
    send_to_driver: Any
    fault: Any
