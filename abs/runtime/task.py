"""A task: one thread running a chain of operators for one subtask.

Non-source tasks consume their input gate through the barrier aligner (a channel that
delivered barrier ``n`` is not consumed until every live channel has delivered it); source
tasks poll their reader and inject barriers between two polls when the coordinator
triggers a checkpoint. At a completed alignment (or a trigger, for sources) the task:

1. takes the synchronous part of the snapshot of every operator in the chain,
2. forwards the barrier on every output channel,
3. hands the snapshot to the worker's uploader (asynchronous part) and goes on.

In ``stop_the_world`` mode (benchmark baseline) sources pause after the barrier until the
checkpoint completes, and the snapshot is full and uploaded before the barrier is forwarded.
"""
from __future__ import annotations

import collections
import threading
import time
import traceback
from typing import Any

import pyarrow as pa

from ..alignment import AbortCheckpoint, BarrierAligner, EndOfInput, TriggerSnapshot
from ..connectors.sources import END
from . import messages as m
from .channels import EOS, Announcement, Barrier, CancelMarker, CaptureComplete, InputGate, StepMarker
from ..reconfig.aligner import StepAligner
from ..reconfig.holding import Holding
from .operators import KeyedOp, OperatorRuntime, OpSnapshot, SinkOp, UserFunctionError
from .plan import TaskPlan, task_key
from .exchange import ExchangeWriter
from .loops import FeedbackLogs, IterationHead, _merged
from .split_readers import SourceReaders
from .unaligned import UnalignedCheckpoints

__all__ = ["Task", "ExchangeWriter"]


class _Stopped(Exception):
    """The worker stopped the task while it waited for key groups' state."""


class Task(IterationHead, UnalignedCheckpoints, threading.Thread):
    def __init__(
        self,
        plan: TaskPlan,
        subtask: int,
        operators: dict[int, OperatorRuntime],
        gate: InputGate,
        outputs: list[ExchangeWriter],
        worker: Any,
        reader: Any = None,
    ) -> None:
        super().__init__(name=f"{plan.name()}#{subtask}", daemon=True)
        self.plan = plan
        self.subtask = subtask
        self.key = task_key(plan.index, subtask)
        self.ops = operators  # node index -> runtime, in topological order
        self.head = operators[plan.head]
        self.gate = gate
        self.outputs = outputs
        self.worker = worker
        self.reader = reader
        self.mode = worker.checkpoint_mode
        self.alignment_started: dict[int, float] = {}
        self.bases: dict[int, int] = {}  # checkpoint id -> its base (see Barrier.base)
        self.last_completed = 0
        self.finished = threading.Event()
        # live reconfiguration (abs.reconfig): step markers align like barriers; a keyed head
        # holds the rows of key groups it gains until their state is installed
        self.steps = StepAligner(gate.num_channels)
        self._marker: StepMarker | None = None  # the step being aligned
        self.keyed = self.head if isinstance(self.head, KeyedOp) else None
        self.holding = Holding(self.keyed.extractor.max_parallelism) if self.keyed is not None else None
        self._early: list = []  # installs of a step this task has not aligned yet
        # rescale (abs.reconfig.plan): input channels from joining workers, which enter the
        # barrier alignment at the join step's marker; a source's splits handed over to it
        self._joined: list[int] = []
        self._awaiting_splits: set[int] = set()
        self.splits_gained = 0
        self.aligner: BarrierAligner | None = None
        # load: seconds waiting for input (idle) since the task started; time blocked on full
        # output channels (backpressured) is summed from its senders (see load())
        self.started = time.perf_counter()
        self.idle = 0.0
        # an iteration head (abs.runtime.loops): its feedback logs, set by the worker; the
        # restored logs it processes before anything else; whether its regular inputs ended
        self.loop: FeedbackLogs | None = None
        self.replay: list = []
        self._ended = False
        # unaligned checkpoints (abs.runtime.unaligned): snapshot at the first barrier heard of
        # (mode "unaligned") or when an alignment takes longer than alignment_timeout; the
        # upload jobs held until their channel state is captured; announcements kept for a switch
        spec = getattr(worker, "spec", None)
        self.unaligned = self.mode == "unaligned"
        self.alignment_timeout = getattr(spec, "alignment_timeout", None)
        self.announce = self.unaligned or self.alignment_timeout is not None
        # a source's key_by writers coalesce small slices (abs.runtime.exchange); not where a
        # send must never block (announced barriers), nor in loops
        flow = getattr(spec, "flow", None)
        if reader is not None and not self.announce and not (flow is not None and flow.has_loops):
            for out in outputs:
                out.enable_coalescing()
        self._held: dict[int, Any] = {}
        self._heard: dict[int, tuple[float, int, dict[int, int]]] = {}  # id -> (first heard, base, channel -> index)
        self._last_unaligned = 0

    # ------------------------------------------------------------------ entry
    def run(self) -> None:
        try:
            for op in self.ops.values():
                op.open()
            if self.reader is not None:
                self._run_source()
            else:
                try:
                    self._run_inputs()
                except _Stopped:
                    pass  # as a Stop read from the gate
            for op in self.ops.values():
                op.close()
            self.worker.task_finished(self)
        except UserFunctionError as exc:
            self.worker.task_failed(self, exc.uid, traceback.format_exc())
        except Exception as exc:  # noqa: BLE001 - reported to the driver, which fails the job
            uid = getattr(exc, "uid", None) or self.head.uid
            self.worker.task_failed(self, uid, traceback.format_exc())
        finally:
            self.finished.set()

    # ------------------------------------------------------------------ sources
    def _run_source(self) -> None:
        reader = self.reader = SourceReaders(self.reader)
        head = self.head
        exhausted = paused = False
        wait = 0.0
        deferred: collections.deque = collections.deque()  # control events held while splits are awaited
        while True:
            if deferred and not self._awaiting_splits:
                event = deferred.popleft()
            elif wait:
                for out in self.outputs:  # no input now: what the writers hold goes out
                    if out.held:
                        out.flush()
                t0 = time.perf_counter()
                event = self.gate.wait_control(wait)
                self.idle += time.perf_counter() - t0
            else:
                event = self.gate.wait_control(0)
            wait = 0.0
            if event is not None:
                if self._awaiting_splits and not isinstance(event, (m.SplitsHandover, m.Stop)):
                    # a rescale hands splits to this task: nothing that snapshots or ends it
                    # goes before they arrived (their offsets belong to every later checkpoint)
                    deferred.append(event)
                    wait = 0.005
                    continue
                match event:
                    case m.TriggerCheckpoint(checkpoint_id=cid, base=base):
                        self._catch_up(base)
                        offsets = reader.offsets()
                        self._snapshot(cid, base, source_offsets=offsets)
                        if self.mode == "stop_the_world":
                            paused = True
                    case m.StartStep():
                        self._catch_up(event.base)
                        marker = StepMarker(event.step, event.moves, event.base, event.workers, event.phase)
                        for out in self.outputs:
                            out.switch(marker)
                        self.worker.fault("after_routing_switch", self)
                        if event.split_moves:
                            self._hand_splits(event)
                        if event.phase == "retire" and self.subtask >= event.workers:
                            self.worker.fault("before_retire", self)
                            self._end_of_input()  # a leaving worker's source: its channels end here
                            reader.close()
                            return
                    case m.SplitsHandover():
                        self._awaiting_splits.discard(event.source)
                        source = self.worker.spec.flow.nodes[self.plan.head].spec["source"]
                        reader.add(source.create_reader(event.splits, self.subtask, self.worker.spec.parallelism))
                        self.splits_gained += 1
                        exhausted = False
                    case m.Resume():
                        paused = False
                    case m.Finish():
                        self._end_of_input()
                        reader.close()
                        return
                    case m.Stop():
                        return
                    case m.CheckpointCompleted():
                        self._control(event)
                        reader.notify_checkpoint_complete(event.checkpoint_id, {})
                    case _:
                        self._control(event)
                continue
            if paused or exhausted:
                wait = 0.05
                continue
            if self.announce and not self._outputs_ready():
                wait = 0.002  # read nothing that cannot go out: a trigger is then taken at once
                continue
            batch = reader.poll()
            if batch is END:
                exhausted = True
                self.worker.source_exhausted(self)
            elif batch is None:
                wait = max(0.0005, reader.wait_hint())
            elif batch.num_rows:
                head.records_in += batch.num_rows
                head.emit(batch)

    def _hand_splits(self, step: m.StartStep) -> None:
        """A rescale's join or drain step moves source splits (``StartStep.split_moves``:
        ``(source uid, from, to, splits)``): a task that gives splits stops reading them now
        (their offsets: every record read so far went out before the step's marker), hands
        them over through the driver and reads on the splits it keeps with a reader of its
        own; a task that gains splits waits for them before anything that snapshots or ends it."""
        uid = self.head.uid
        giving = [(to, splits) for u, frm, to, splits in step.split_moves if u == uid and frm == self.subtask]
        if giving:
            offsets = self.reader.release()
            self.worker.fault("during_split_handover", self)
            for to, splits in giving:
                missing = [s for s in splits if s not in offsets]
                if missing:
                    raise RuntimeError(f"source {uid!r} of subtask {self.subtask} does not read split(s) {missing} "
                                       "the rescale moves from it (the driver's split owners disagree: a bug)")
                given = {s: offsets.pop(s) for s in splits}
                self.worker.send_to_driver(m.SplitsHandover(step.step, uid, self.subtask, to, given))
            if offsets:  # the splits it keeps
                source = self.worker.spec.flow.nodes[self.plan.head].spec["source"]
                self.reader.add(source.create_reader(offsets, self.subtask, self.worker.spec.parallelism))
        for u, frm, to, _splits in step.split_moves:
            if u == uid and to == self.subtask:
                self._awaiting_splits.add(frm)

    # ------------------------------------------------------------------ inputs
    def _run_inputs(self) -> None:
        aligner = self.aligner = BarrierAligner(self.gate.num_channels)
        steps = self.steps
        head = self.head
        holding = self.holding
        loop = self.loop
        feedback = loop.channels if loop is not None else frozenset()
        for ch in feedback:
            aligner.on_end_of_stream(ch)  # the feedback channels take no part in alignment
        if self.replay:
            self.worker.fault("during_replay", self)
            for batch in self.replay:  # the restored channel state first (a loop's log, overtaken records)
                head.process(batch)
            self.replay = []
        while True:
            if self._heard and self.alignment_timeout is not None:
                self._check_alignment_timeout(aligner)
            blocked = aligner.blocked if steps.aligning is None else aligner.blocked | steps.blocked
            if loop is not None and loop.blocked:
                blocked = blocked | loop.blocked
            t0 = time.perf_counter()
            if self.announce and not self._outputs_ready():
                # take no record that could not go out (the task would block in a send, deaf
                # to announcements): only control events and announcements, until there is room
                got = self.gate.take(self._all_channels(), 0.002)
            else:
                got = self.gate.take(blocked, 0.05)
            self.idle += time.perf_counter() - t0
            if got is None:
                continue
            channel, item = got
            if channel < 0:
                if isinstance(item, m.Stop):
                    return
                if isinstance(item, CaptureComplete):
                    self._captured(item.checkpoint_id)
                    continue
                if isinstance(item, m.CheckpointAborted):
                    self._drop_unaligned(item.checkpoint_id)
                    if loop is not None:
                        loop.drop(item.checkpoint_id)
                    self._act(aligner.abort(item.checkpoint_id))
                if isinstance(item, m.InstallState):
                    self._install(item)
                    continue
                if isinstance(item, m.ChannelAdded):
                    self.steps.add_channel(item.channel)
                    self._joined.append(item.channel)
                    continue
                self._control(item)
                continue
            if channel in feedback:
                if self._fed_back(channel, item):
                    return
                continue
            if isinstance(item, Announcement):
                self._announced(channel, item)
                continue
            if self.announce and isinstance(item, (Barrier, CancelMarker)) and self._unaligned_event(channel, item):
                continue
            if isinstance(item, pa.RecordBatch):
                self.worker.fault("process", self, item.num_rows)
                if holding:
                    item = holding.split(item, head.extractor.key_groups(item))
                    if item is None:
                        continue
                elif head.merge_rows > item.num_rows and not self.announce:
                    for batch in self._with_queued(channel, item):
                        head.process(batch)
                    continue
                head.process(item)
            elif isinstance(item, Barrier):
                if aligner.aligning is None:
                    self.alignment_started[item.checkpoint_id] = time.monotonic()
                self.bases[item.checkpoint_id] = item.base
                if self._act(aligner.on_barrier(channel, item.checkpoint_id)):
                    return
                if aligner.aligning is not None:
                    self.worker.fault("during_alignment", self)
            elif isinstance(item, StepMarker):
                self._marker = item
                if steps.on_marker(channel, item.step):
                    self._apply_step(item)
            elif isinstance(item, CancelMarker):
                if self._act(aligner.on_cancel(channel, item.checkpoint_id)):
                    return
            elif item is EOS:
                if steps.on_end_of_stream(channel):
                    self._apply_step(self._marker)
                if self._act(aligner.on_end_of_stream(channel)):
                    return

    def _with_queued(self, channel: int, item: pa.RecordBatch) -> list:
        """``item`` and the record batches queued behind it on ``channel`` (none past a barrier,
        marker or end of stream: they stay queued), up to about the head's ``merge_rows`` rows,
        merged into one batch (left as they are when their schemas differ). Not while
        checkpoints may be unaligned (``announce``): there, what is queued is channel state."""
        more = self.gate.take_batches((channel,), self.head.merge_rows - item.num_rows)
        if not more:
            return [item]
        for _ch, batch in more:
            self.worker.fault("process", self, batch.num_rows)
        return _merged([item, *(batch for _ch, batch in more)])

    def load(self) -> tuple[float, float, float]:
        """Seconds since the task started, of them waiting for input (idle) and blocked on
        full output channels (backpressured); the rest it was busy. Read by the worker's
        metrics thread (plain float reads: a figure a moment old at worst)."""
        backpressured = sum(s.blocked for out in self.outputs for s in out.senders)
        return time.perf_counter() - self.started, self.idle, backpressured

    # ------------------------------------------------------------------ reconfiguration
    def _apply_step(self, marker: StepMarker | None) -> None:
        """Step ``marker`` is aligned: hand over the key groups this task loses, hold the rows
        of those it gains, forward the marker and switch the routing (abs.reconfig)."""
        assert marker is not None
        self._catch_up(marker.base)
        if marker.phase == "join" and self.aligner is not None:
            # every checkpoint before the join is closed here (its barriers came before the
            # marker on every old channel); the new channels count from the next one
            for ch in self._joined:
                self.aligner.add_channel(ch)
            self._joined = []
        keyed = self.keyed
        if keyed is not None:
            mine = keyed.key_group_range
            for kg, target in marker.moves:
                if target != self.subtask and kg in mine:
                    self.worker.fault("before_handover", self)
                    tables, chains = keyed.hand_out(kg, full=not self.worker.checkpointing)
                    self.worker.hand_over(self, marker.step, keyed.uid, kg, target, tables, chains)
                elif target == self.subtask and kg not in mine:
                    self.holding.hold(kg)
        for out in self.outputs:
            out.switch(marker)
        self.worker.fault("after_routing_switch", self)
        early, self._early = self._early, []
        for install in early:
            self._install(install)

    def _install(self, install: m.InstallState) -> None:
        """The state of a key group this task gains arrived: load it, then process its held
        rows in arrival order."""
        keyed = self.keyed
        if keyed is None or install.operator != keyed.uid:
            raise m.unexpected(install, f"task {self.key}", "its worker", "the state of this task's operator")
        if install.step > self.steps.last_aligned:
            self._early.append(install)  # before the step: the key group is still its old owner's
            return
        self.worker.fault("before_install", self)
        keyed.take_in(install.key_group, install.base, install.changes)
        for batch in self.holding.release(install.key_group):
            keyed.process(batch)
        self.worker.fault("after_install", self)
        self.worker.installed(self, install)

    def _await_installs(self) -> None:
        """Wait (on control events only) until every key group this task gains is installed:
        a checkpoint taken before would miss them, at the old owner and here. The old owners
        hand them over when they align the step, which came before (markers and barriers
        travel in one order on every channel), so this wait ends."""
        deferred: list = []
        while self.holding:
            got = self.gate.take(frozenset(range(self.gate.num_channels)), 0.05)
            if got is None:
                continue
            _channel, item = got
            if isinstance(item, m.InstallState):
                self._install(item)
            elif isinstance(item, m.Stop):
                raise _Stopped()
            elif isinstance(item, m.ChannelAdded):
                self.steps.add_channel(item.channel)
                self._joined.append(item.channel)
            elif isinstance(item, m.CheckpointCompleted):
                self._control(item)
            else:
                deferred.append(item)
        for item in deferred:
            self.gate.put_control(item)

    def _act(self, actions: Any) -> bool:
        """Carry out aligner actions; True when every input has ended."""
        for action in actions:
            if isinstance(action, (TriggerSnapshot, EndOfInput)) and self.holding:
                self._await_installs()
            if isinstance(action, TriggerSnapshot):
                started = self.alignment_started.pop(action.checkpoint_id, time.monotonic())
                base = self.bases.pop(action.checkpoint_id, 0)
                self._catch_up(base)
                self._snapshot(action.checkpoint_id, base, alignment_time=time.monotonic() - started)
            elif isinstance(action, AbortCheckpoint):
                self.alignment_started.pop(action.checkpoint_id, None)
                for op in self.ops.values():
                    op.notify_abort(action.checkpoint_id)
                for out in self.outputs:
                    out.send_all(CancelMarker(action.checkpoint_id))
                self.worker.decline(self, action.checkpoint_id, action.reason)
            elif isinstance(action, EndOfInput):
                for cid in list(self._held):  # every channel ended: their channel state is complete
                    self._captured(cid)
                self._end_of_input()
                self._ended = True
                # an iteration head goes on until the loop has ended too (its feedback channels)
                return self.loop is None or not self.loop.live
        return False

    # ------------------------------------------------------------------ shared
    def _catch_up(self, base: int) -> None:
        """A barrier built on checkpoint ``base`` arrived before the notice that ``base`` is
        complete (the notice travels on the control connection, the barrier on data
        channels): take the barrier as the notice."""
        if base > self.last_completed:
            self._control(m.CheckpointCompleted(base))

    def _control(self, event: Any) -> None:
        """A completion or abort notice for every operator of the chain; an unknown message
        raises :class:`~abs.runtime.messages.ProtocolError` (the task fails with it)."""
        match event:
            case m.CheckpointCompleted(checkpoint_id=cid):
                if cid <= self.last_completed:
                    return  # already applied (a barrier carried the notice first)
                self.last_completed = cid
                for op in self.ops.values():
                    op.notify_complete(cid)
            case m.CheckpointAborted(checkpoint_id=cid):
                for op in self.ops.values():
                    op.notify_abort(cid)
            case _:
                raise m.unexpected(event, f"task {self.key}", "its worker", "a checkpoint notice")

    def _snapshot(
        self, checkpoint_id: int, base: int, alignment_time: float = 0.0, source_offsets: dict | None = None,
        hold: bool = False,
    ) -> Any:
        full = self.mode == "stop_the_world"
        snapshot_at = time.monotonic()
        t0 = time.perf_counter()
        self.worker.fault("before_snapshot", self)
        pieces: list[OpSnapshot] = []
        # without storage the only "checkpoints" are a loop's termination probes: nothing is taken
        for op in self.ops.values() if self.worker.checkpointing else ():
            snap = op.snapshot(checkpoint_id, full)
            if snap is not None:
                pieces.append(snap)
        if source_offsets is not None and self.worker.checkpointing:
            pieces.append(OpSnapshot(self.head.uid, source_offsets=source_offsets))
        sync_time = time.perf_counter() - t0
        self.worker.fault("after_sync_snapshot", self)
        job = m.UploadJob(checkpoint_id, self, pieces, alignment_time, sync_time, snapshot_at)
        if full:
            self.worker.upload_now(job)  # stop-the-world: nothing moves until it is stored
        barrier = Barrier(checkpoint_id, base)
        if self.announce:  # ahead of the queued records first, on every output, then in order
            for out in self.outputs:
                out.announce(barrier)
        for out in self.outputs:
            out.send_all(barrier)
        self.worker.fault("after_barrier_forward", self)
        # Arrow's allocator keeps what this thread freed (a source's first batches, the
        # batches since the last checkpoint) for its next allocations: handed back once a
        # checkpoint (well under 1 ms), after the barrier went on. Reference job (process, 100 k string
        # keys, p=1): peak distinct pages 156-164 -> 152-160 MB, PSS 127-133 -> 125-131 MB
        pa.default_memory_pool().release_unused()
        if hold:
            return job
        if self.loop is not None:
            self._logged(self.loop.start(checkpoint_id, job))  # acked once the barrier came round
        elif not full:
            self.worker.upload_later(job)

    def _end_of_input(self) -> None:
        for op in self.ops.values():
            op.end_input()
            if isinstance(op, SinkOp) and not self.worker.checkpointing:
                op.commit_all()
        for out in self.outputs:
            out.send_all(EOS)
