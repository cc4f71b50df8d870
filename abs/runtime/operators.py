"""Operator runtimes: what a task runs for each node of its chain.

Every operator receives Arrow batches in :meth:`OperatorRuntime.process` and pushes its
output to ``self.outputs`` (chained operators' ``process`` or exchange writers). At a
barrier the task calls :meth:`OperatorRuntime.snapshot` on every operator of the chain, in
topological order, *before* forwarding the barrier: that is the synchronous part of the
snapshot, and it returns an :class:`OpSnapshot` that the uploader turns into files.
"""
from __future__ import annotations

import types
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa

from abscore.gcpause import gc_paused
from storage.session import CheckpointSession

from ..dataflow import Node
from ..errors import GraphError, StateError
from ..keygroups import KeyGroupSet, key_groups
from ..connectors.sinks import CollectSink, SinkWriter
from ..state import AggregateBackend, KeyedBackend, KeyedStateBackend
from ..state.handover import adopt_key_group, export_key_group, release_key_group

from .operator_base import (KeyExtractor, OperatorRuntime, OpSnapshot, UserFunctionError, _call, _to_batch,
                            batch_rows, keyed_loop)

__all__ = ["OpSnapshot", "OperatorRuntime", "build_operator", "KeyExtractor", "UserFunctionError", "batch_rows"]


class MapOp(OperatorRuntime):
    def process(self, batch: pa.RecordBatch) -> None:
        self.records_in += batch.num_rows
        fn = self.node.spec["fn"]
        try:
            out = [fn(r) for r in batch_rows(batch)[0]]
        except Exception as exc:
            raise UserFunctionError(self.uid, "the map function", exc) from exc
        self.emit(_to_batch(out, self.uid))


class FilterOp(OperatorRuntime):
    def process(self, batch: pa.RecordBatch) -> None:
        self.records_in += batch.num_rows
        fn = self.node.spec["fn"]
        try:
            mask = [bool(fn(r)) for r in batch_rows(batch)[0]]
        except Exception as exc:
            raise UserFunctionError(self.uid, "the filter function", exc) from exc
        self.emit(batch.filter(pa.array(mask, pa.bool_())))


class FlatMapOp(OperatorRuntime):
    def process(self, batch: pa.RecordBatch) -> None:
        self.records_in += batch.num_rows
        fn = self.node.spec["fn"]
        out: list = []
        try:
            for r in batch_rows(batch)[0]:
                out.extend(fn(r))
        except Exception as exc:
            raise UserFunctionError(self.uid, "the flat_map function", exc) from exc
        self.emit(_to_batch(out, self.uid))


class MapBatchesOp(OperatorRuntime):
    def process(self, batch: pa.RecordBatch) -> None:
        self.records_in += batch.num_rows
        out = _call(self.uid, "the map_batches function", self.node.spec["fn"], batch)
        if out is None:
            return
        if isinstance(out, pa.Table):
            for b in out.to_batches():
                self.emit(b)
        elif isinstance(out, pa.RecordBatch):
            self.emit(out)
        else:
            raise GraphError(
                f"operator {self.uid!r}: map_batches must return a pyarrow RecordBatch, Table or None, "
                f"got {type(out).__name__}"
            )


# ----------------------------------------------------------------------------- keyed


def read_ahead(read_chain: Callable[[list], pa.Table], items: Sequence[tuple], readers: int) -> Iterator[tuple]:
    """``(item, read_chain(item[-1]))`` for each item, in order, read by ``readers`` threads at
    most ``2 * readers`` items ahead of the caller (one thread: read as it goes). Reading is
    decompressing (pyarrow does it without the GIL) or, from an object store, waiting on
    requests; loading a table is cheap (:mod:`abs.state.restored`). An error is raised where
    its item comes, as a serial read raises it; the reads not started then are dropped."""
    if readers <= 1 or len(items) < 2:
        for item in items:
            yield item, read_chain(item[-1])
        return
    with ThreadPoolExecutor(max_workers=readers, thread_name_prefix="abs-restore") as pool:
        pending: deque = deque()
        try:
            for item in items:
                pending.append((item, pool.submit(read_chain, item[-1])))
                if len(pending) >= 2 * readers:
                    first, future = pending.popleft()
                    yield first, future.result()
            while pending:
                first, future = pending.popleft()
                yield first, future.result()
        finally:
            for _item, future in pending:
                future.cancel()


class _SharedRange(list):
    """The ``(key group, chain)`` pairs of one state whose chains are each their rows of one
    shared range alone: read together (:meth:`SnapshotStore.read_range`)."""

    __slots__ = ()


def _restore_units(wanted: Sequence[tuple]) -> list[tuple]:
    """``wanted`` (``(state, key group, chain)``) as units to read: ``(state, kg, chain)`` for a
    key group read alone, ``(state, first kg, _SharedRange)`` for the key groups of one state
    whose chains are a single reference each to rows of the same shared range (two or more),
    in the place of the first of them."""
    units: list[tuple] = []
    ranges: dict[tuple, _SharedRange] = {}
    for state, kg, chain in wanted:
        ref = chain[0] if len(chain) == 1 else None
        if ref is None or not ref.shared or ref.kind != "base":
            units.append((state, kg, chain))
            continue
        key = (state, ref.path, ref.offset, ref.read_size, ref.checksum)
        group = ranges.get(key)
        if group is None:
            group = ranges[key] = _SharedRange()
            units.append((state, kg, group))
        group.append((kg, chain))
    # a range of one key group is read as any chain is
    return [(s, kg, u[0][1]) if type(u) is _SharedRange and len(u) == 1 else (s, kg, u) for s, kg, u in units]


class KeyedOp(OperatorRuntime):
    """Base of operators with keyed state: owns the state backend, the confirmed chain
    of files per key group, and the snapshot/confirm cycle."""

    stateful = True
    backend: KeyedBackend  # restore, snapshot, confirm and abort go through the protocol only

    def __init__(self, node: Node, ctx: Any) -> None:
        super().__init__(node, ctx)
        key = node.inputs[0].key
        self.extractor = KeyExtractor(node.uid, key, ctx.max_parallelism)
        self.backend = KeyedStateBackend(
            node.uid, node.spec.get("state", ()), ctx.max_parallelism, ctx.key_group_range
        )
        self.chains = CheckpointSession()  # the chains of this subtask's key groups, confirmed and pending
        self.chains.declare(node.uid, (s.name for s in node.spec.get("state", ())))
        self.full_pending: set[int] = set()
        self.need_full = False  # restored from another root: the next snapshot must be full
        self.last_captured = 0  # the newest checkpoint this subtask snapshotted
        # records processed per key group (autoscaling finds hot key groups with it)
        self.kg_records = np.zeros(ctx.max_parallelism, dtype=np.int64)

    @property
    def key_group_range(self) -> KeyGroupSet:
        """The key groups this subtask owns now (its backend's: live reconfiguration changes them)."""
        return self.backend.key_group_range

    def restore(self, chains: dict, read_chain: Callable[[list], pa.Table], same_root: bool = True,
                on_read: Callable[[int], None] | None = None, readers: int = 1,
                read_range: Callable[[list], tuple[pa.Table, list]] | None = None) -> int:
        """Load this subtask's key groups: ``chains`` (state -> kg -> [FileRef]) holds exactly
        them, as the driver's restore plan assigned them (``RestorePlan.keyed_chains``); a key
        group outside this subtask's range is a bug of the plan and fails the restore.

        ``same_root``: the chains live in the storage root this job writes to, so new deltas
        can build on them; otherwise (a savepoint elsewhere) the first checkpoint is full.
        Returns bytes read; ``on_read(bytes)`` hears of each key group read (progress).
        ``readers``: key groups read (fetched and decoded) at once, ahead of the one being
        loaded (see :func:`read_ahead`). ``read_range`` (:meth:`SnapshotStore.read_range`):
        the key groups whose chains are each their rows of one shared range alone (after a
        full checkpoint, every small key group: thousands of them at a large max_parallelism)
        are read with it, the range once, and loaded together (the backend's
        ``restore_slices`` where it has one); without it each key group is read alone."""
        outside = sorted({kg for by_kg in chains.values() for kg in by_kg if kg not in self.key_group_range})
        if outside:
            raise StateError(
                f"operator {self.uid!r}: the restore plan gave subtask {self.task_key} key group(s) {outside}, "
                f"outside its range {self.key_group_range}; nothing was restored; report this bug"
            )
        self.need_full = not same_root
        wanted = [(state, kg, chain) for state, by_kg in chains.items() if state in self.confirmed_chains
                  for kg, chain in by_kg.items()]  # compatibility is checked by the driver before anything runs
        expect = getattr(self.backend, "expect_restore", None)
        if expect is not None:  # the keys of a key group: at most the rows of its longest state's chain
            rows: dict[int, int] = {}
            for _state, kg, chain in wanted:
                rows[kg] = max(rows.get(kg, 0), sum(ref.rows for ref in chain))
            expect(sum(rows.values()))
        units = _restore_units(wanted) if read_range is not None else [(s, kg, c) for s, kg, c in wanted]

        def read(unit: Any) -> Any:
            return read_range([c for _kg, c in unit]) if type(unit) is _SharedRange else read_chain(unit)

        restore_slices = getattr(self.backend, "restore_slices", None)
        with gc_paused():  # objects by the hundred thousand, none of them garbage
            nbytes = self._load_units(units, read, readers, same_root, on_read, restore_slices)
        self.backend.finish_restore()
        return nbytes

    def _load_units(self, units: list, read: Callable[[Any], Any], readers: int, same_root: bool,
                    on_read: Callable[[int], None] | None, restore_slices: Callable | None) -> int:
        nbytes = 0
        for (state, kg, unit), got in read_ahead(read, units, readers):
            members = unit if type(unit) is _SharedRange else ((kg, unit),)
            read_bytes = sum(ref.bytes for _kg, chain in members for ref in chain)
            nbytes += read_bytes
            if on_read is not None:
                on_read(read_bytes)
            if type(unit) is _SharedRange:
                table, parts = got
                slices = [(g, o, n) for (g, _c), (o, n) in zip(unit, parts)]
                if restore_slices is not None:
                    restore_slices(state, table, slices)
                else:
                    for g, o, n in slices:
                        self.backend.restore(state, g, table.slice(o, n))
            else:
                self.backend.restore(state, kg, got)
            if same_root:
                for g, chain in members:
                    self.chains.restored(self.uid, state, g, chain)
        return nbytes

    def snapshot(self, checkpoint_id: int, full: bool = False) -> OpSnapshot:
        self.last_captured = checkpoint_id
        full = full or self.need_full
        if self.need_full:
            self.full_pending.add(checkpoint_id)
        with gc_paused():  # the synchronous part: objects by the key group, none of them garbage
            deltas = self.backend.capture_full(checkpoint_id) if full else self.backend.capture(checkpoint_id, lazy=True)
            prev = self.chains.prev_chains(self.uid, full=full)
        return OpSnapshot(self.uid, deltas=deltas, prev_chains=prev, on_chains=self._chains_written)

    @property
    def confirmed_chains(self) -> dict:
        """state -> key group -> chain: what the next checkpoint builds on."""
        return self.chains.confirmed(self.uid)

    def _chains_written(self, checkpoint_id: int, chains: dict) -> None:
        self.chains.written(checkpoint_id, self.uid, chains)

    def notify_complete(self, checkpoint_id: int) -> None:
        if self.chains.confirm(checkpoint_id, self.uid):
            self.backend.confirm(checkpoint_id)
            if checkpoint_id in self.full_pending:
                self.need_full = False
        self.full_pending = {c for c in self.full_pending if c > checkpoint_id}

    def notify_abort(self, checkpoint_id: int) -> None:
        self.chains.abort(checkpoint_id, self.uid)
        self.backend.abort(checkpoint_id)

    # ------------------------------------------------------------------ live reconfiguration
    def _export(self, kg: int, full: bool) -> dict[str, pa.Table]:
        return export_key_group(self.backend, kg, full=full)

    def _release(self, kg: int) -> None:
        release_key_group(self.backend, kg)

    def _adopt(self, kg: int, base: dict[str, pa.Table], changes: dict[str, pa.Table]) -> None:
        adopt_key_group(self.backend, kg, base, changes)

    def hand_out(self, kg: int, *, full: bool) -> tuple[dict[str, pa.Table], dict[str, list]]:
        """Key group ``kg`` leaves this subtask: its state (what changed since the last
        confirmed checkpoint, or all of it with ``full`` or when that checkpoint's chains are
        not this root's) and the chains that state builds on (state -> chain; empty when
        full). The key group is forgotten here (:mod:`abs.state.handover`)."""
        full = full or self.need_full
        chains = {} if full else {state: list(by_kg[kg]) for state, by_kg in self.confirmed_chains.items()
                                  if kg in by_kg}
        tables = self._export(kg, full)
        self._release(kg)
        self.chains.forget(self.uid, kg, self.last_captured)
        return tables, chains

    def take_in(self, kg: int, base: dict[str, pa.Table], changes: dict[str, pa.Table]) -> None:
        """Key group ``kg`` joins this subtask: ``base`` (state -> the resolved chain the
        changes build on) then ``changes`` (state -> delta table) from :meth:`hand_out`."""
        self._adopt(kg, base, changes)
        self.chains.forget(self.uid, kg, self.last_captured)


class ProcessContext:
    """The ``ctx`` of a process function: ``key`` (the current record's key), ``emit(record)``
    and ``state`` (one attribute per declared state, its handle). Slotted: the runtime writes
    ``key`` before every call and nearly every function reads ``ctx.state.<name>``; a slot is
    read or written in ~15-25 ns where a ``types.SimpleNamespace`` attribute took ~60
    (microbenchmark, Python 3.11). Other attributes a function sets on ``ctx`` still work."""

    __slots__ = ("key", "emit", "state", "__dict__")

    def __init__(self, state: Any) -> None:
        self.key: Any = None
        self.emit: Any = None
        self.state = state


def _state_namespace(handles: dict[str, Any]) -> Any:
    """``ctx.state``: an object with one slot per state name (see :class:`ProcessContext`); a
    ``types.SimpleNamespace`` when a name cannot be a slot (not an identifier, or private)."""
    names = tuple(handles)
    if not all(n.isidentifier() and not n.startswith("__") for n in names):
        return types.SimpleNamespace(**handles)

    def __repr__(self: Any) -> str:
        return "namespace(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in names) + ")"

    state = type("State", (), {"__slots__": names, "__repr__": __repr__})()
    for name, handle in handles.items():
        setattr(state, name, handle)
    return state


class ProcessOp(KeyedOp):
    backend: KeyedStateBackend  # handles, per record

    def open(self) -> None:
        self.fn = self.node.spec["fn"]
        self.context = ProcessContext(
            _state_namespace({s.name: self.backend.state(s.name) for s in self.node.spec.get("state", ())}))

    def process(self, batch: pa.RecordBatch) -> None:
        n = batch.num_rows
        self.records_in += n
        extractor = self.extractor
        out: list = []
        ctx = self.context
        ctx.emit = out.append
        backend = self.backend
        fn = self.fn
        if isinstance(extractor.key, str):  # keyed by a column: rows built in the loop (keyed_loop)
            at = extractor._index(batch, extractor.key)
            kg_arr = key_groups(batch.column(at), extractor.max_parallelism)
            self.kg_records += np.bincount(kg_arr, minlength=len(self.kg_records))
            loop = keyed_loop(tuple(batch.schema.names), at)
            columns = [col.to_pylist() for col in batch.columns]
            try:
                loop(fn, ctx, backend, kg_arr.tolist(), columns)
            except Exception as exc:
                raise UserFunctionError(self.uid, "the process function", exc) from exc
            self.emit(_to_batch(out, self.uid))
            return
        rows, columns = batch_rows(batch)
        keys = extractor.keys(batch, rows, columns)
        kg_arr = extractor.key_groups(batch, rows)
        self.kg_records += np.bincount(kg_arr, minlength=len(self.kg_records))
        try:
            for k, g, row in zip(keys, kg_arr.tolist(), rows):
                backend.current_key = k
                backend.current_kg = g
                ctx.key = k
                fn(ctx, row)
        except Exception as exc:
            raise UserFunctionError(self.uid, "the process function", exc) from exc
        self.emit(_to_batch(out, self.uid))


class ReduceOp(KeyedOp):
    backend: KeyedStateBackend  # handles, per record

    def open(self) -> None:
        self.acc = self.backend.state("acc")

    def process(self, batch: pa.RecordBatch) -> None:
        self.records_in += batch.num_rows
        rows, columns = batch_rows(batch)
        keys = self.extractor.keys(batch, rows, columns)
        kg_arr = self.extractor.key_groups(batch, rows)
        self.kg_records += np.bincount(kg_arr, minlength=len(self.kg_records))
        kgs = kg_arr.tolist()
        fn = self.node.spec["fn"]
        backend, acc = self.backend, self.acc
        out = []
        try:
            for k, g, row in zip(keys, kgs, rows):
                backend.current_key = k
                backend.current_kg = g
                old = acc.value()
                new = row if old is None else fn(old, row)
                acc.update(new)
                out.append(new)
        except Exception as exc:
            raise UserFunctionError(self.uid, "the reduce function", exc) from exc
        self.emit(_to_batch(out, self.uid))


MERGE_ROWS = 32_768
"""About how many queued rows :class:`AggregateOp` takes in as one batch (``merge_rows``)."""


class AggregateOp(KeyedOp):
    """Vectorized keyed aggregation (``KeyedStream.aggregate``). The work is done by
    :class:`abs.runtime.aggregate.Aggregator`: a columnar state store for integer, string and
    binary keys, the dict-based KeyedStateBackend for other keys. ``self.backend`` is its
    :class:`~abs.state.AggregateBackend`, which KeyedOp's snapshot/restore use."""

    columnar = True  # False: always the dict path (tests compare the two)
    backend: AggregateBackend

    def __init__(self, node: Node, ctx: Any) -> None:
        super().__init__(node, ctx)
        from .aggregate import Aggregator

        self.aggregator = Aggregator(node, self.backend, columnar=self.columnar)
        self.backend = self.aggregator.backend
        # each batch costs the columnar path ~80 numpy calls whatever its size: batches queued
        # together go in as one (the rows of 3 batches of 8,192 string keys: 15-20 % less CPU).
        # Not with emit="updates", whose updates are one row per key of each batch processed.
        self.merge_rows = MERGE_ROWS if node.spec["emit"] == "none" else 0

    # key groups move in the columnar store's own form while it holds them (AggregateBackend)
    def _export(self, kg: int, full: bool) -> dict[str, pa.Table]:
        return self.backend.export_key_group(kg, full=full)

    def _release(self, kg: int) -> None:
        self.backend.release_key_group(kg)

    def _adopt(self, kg: int, base: dict[str, pa.Table], changes: dict[str, pa.Table]) -> None:
        self.backend.adopt_key_group(kg, base, changes)

    def process(self, batch: pa.RecordBatch) -> None:
        self.records_in += batch.num_rows
        self.emit(self.aggregator.process(batch))


# ----------------------------------------------------------------------------- sinks


class SinkOp(OperatorRuntime):
    """Drives a :class:`SinkWriter` through the two-phase commit of each checkpoint."""

    stateful = True

    def __init__(self, node: Node, ctx: Any, restored_transactions: Sequence[Any] = ()) -> None:
        super().__init__(node, ctx)
        sink = node.spec["sink"]
        if isinstance(sink, CollectSink):
            self.writer: SinkWriter = _CollectWriter(node.uid, ctx.subtask, ctx.send_to_driver, list(restored_transactions))
        else:
            self.writer = sink.create_writer(ctx.subtask, ctx.parallelism, list(restored_transactions))
        self.pending: dict[int, Any] = {}  # checkpoint id -> transaction, pre-committed, not yet committed

    def process(self, batch: pa.RecordBatch) -> None:
        self.records_in += batch.num_rows
        try:
            self.writer.write(batch)
        except Exception as exc:
            raise UserFunctionError(self.uid, "the sink writer", exc) from exc

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """The writer's ``fn(*args)``; what it raises names this sink's uid and the sink (its
        destination), not the operator at the head of the task the sink is chained into."""
        try:
            return fn(*args)
        except UserFunctionError:
            raise
        except Exception as exc:
            raise UserFunctionError(self.uid, f"the sink writer of {self.node.spec['sink']!r} ({what})", exc) from exc

    def snapshot(self, checkpoint_id: int, full: bool = False) -> OpSnapshot:
        txn = self._call(f"pre_commit of checkpoint {checkpoint_id}", self.writer.pre_commit, checkpoint_id)
        if txn is not None:
            self.pending[checkpoint_id] = txn
        # the checkpoint keeps every transaction not yet committed: a restore re-commits them
        return OpSnapshot(self.uid, sink_transactions=[self.pending[c] for c in sorted(self.pending)])

    def notify_complete(self, checkpoint_id: int) -> None:
        ready = sorted(c for c in self.pending if c <= checkpoint_id)
        if ready:
            self.ctx.fault("sink_commit", self.task_key)
            self._call(f"commit of checkpoint {checkpoint_id}", self.writer.commit, checkpoint_id,
                       [self.pending[c] for c in ready])
            for c in ready:
                del self.pending[c]

    def commit_all(self) -> None:
        """End of input with checkpointing off: publish everything now."""
        txn = self._call("pre_commit at the end of input", self.writer.pre_commit, 0)
        txns = [self.pending[c] for c in sorted(self.pending)] + ([txn] if txn is not None else [])
        if txns:
            self._call("commit at the end of input", self.writer.commit, 0, txns)
        self.pending.clear()

    def close(self) -> None:
        self._call("close", self.writer.close)


class _CollectWriter(SinkWriter):
    """A :class:`CollectSink` subtask: a two-phase commit into the driver's memory. An epoch's
    batches are staged in the driver at ``pre_commit`` (under a transaction key unique to this
    writer) and become visible in ``JobResult.collected`` only when its checkpoint completes;
    the driver keeps staged epochs across restarts, so a restored transaction is committed
    again (idempotently) and one no checkpoint names never becomes visible."""

    def __init__(self, uid: str, subtask: int, send: Callable[[Any], None], restored: Sequence[Any] = ()) -> None:
        import uuid

        from .messages import Collect, CollectCommit

        self._collect, self._commit = Collect, CollectCommit

        self.uid = uid
        self.send = send
        self.tag = f"{uid}/{subtask}/{uuid.uuid4().hex[:12]}"
        self.buffer: list[bytes] = []
        if restored:
            self.send(CollectCommit(tuple(restored)))

    def write(self, batch: pa.RecordBatch) -> None:
        from .channels import encode

        self.buffer.append(encode(batch).to_pybytes())

    def pre_commit(self, checkpoint_id: int) -> Any:
        key = f"{self.tag}/{checkpoint_id}"
        self.send(self._collect(key, self.uid, self.buffer))
        self.buffer = []
        return key

    def commit(self, checkpoint_id: int, transactions: Sequence[Any]) -> None:
        self.send(self._commit(tuple(transactions)))


_KINDS = {
    "map": MapOp,
    "filter": FilterOp,
    "flat_map": FlatMapOp,
    "map_batches": MapBatchesOp,
    "union": OperatorRuntime,
    "iterate": OperatorRuntime,  # the head of a loop: merges the entering and the fed-back records
    "process": ProcessOp,
    "reduce": ReduceOp,
    "aggregate": AggregateOp,
}


def build_operator(node: Node, ctx: Any, restored_transactions: Sequence[Any] = ()) -> OperatorRuntime:
    if node.kind == "sink":
        return SinkOp(node, ctx, restored_transactions)
    if node.kind == "source":
        return OperatorRuntime(node, ctx)  # the task drives the reader; this only forwards
    return _KINDS[node.kind](node, ctx)
