"""Writing a checkpoint's state files: key groups (each one's chain plan, then single or
packed files), operator state and channel logs.

For each key group, :func:`storage.chain_decision.decide_chain` decides what to write (keep
the chain, drop it, a delta, a values image, a new base, or a compaction); this module learns
the facts it asks for (encoded sizes, the writer's full image), encodes the file it decided
on (a :class:`_Planned` file: the encoded bytes and the part of the old chain it extends), and
writes the files: one per key group, or packed back to back into one file per (operator,
state). Part of :class:`storage.store.SnapshotStore`, whose write methods build a
:class:`KeyGroupWriter` with the store's current policy and pack limit.
"""
from __future__ import annotations

import dataclasses
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Literal, NamedTuple, Sequence

import pyarrow as pa

from .chain_decision import CaptureFacts, ChainAction, ChainDecision, ChainFacts, Fact, decide_chain
from .chains import CompactionPolicy, resolve_chain
from .errors import DeltaSchemaError, InvalidChainError
from .format import (FAST_LEVEL, EncodedFile, compression_level, delta_for_file, encode_prepared, encode_shared,
                     encode_table, normalize_delta, prepare_table, sort_by_key, table_bytes, values_image)
from .ids import CheckpointId, SubtaskIndex
from .manifest import FileRef, chain_problems
from .paths import FileKind, StoragePaths
from .store_read import ChainReader

if TYPE_CHECKING:  # at run time only annotations name it: a job without a storage root skips fsspec
    from .backend import RootIO

__all__ = ["HIGH_LEVEL_LIMIT", "KeyGroupWrite", "KeyGroupWriter", "PACK_LIMIT", "SHARE_BELOW", "SHARED_RANGE_LIMIT", "put_file",
           "write_table",
           "write_operator_state", "write_channel_log"]

_REMOTE_ENCODERS = 8  # key groups encoded at once for an object store (zstd and Arrow release the GIL)
PACK_LIMIT = 64 << 20
"""A packed file is closed once it holds this many bytes (the last key group may cross it)."""
SHARE_BELOW = 16 << 10
"""A key group's file of fewer in-memory bytes (:func:`storage.format.table_bytes`) than this shares one Arrow
stream in its packed file with the other small files of its kind and schema (format 6). An
Arrow stream of its own costs ~600 bytes (schema, batch header, zstd frames) whatever its
rows: the whole of a key group's delta when 1 % of the keys changed."""
SHARED_RANGE_LIMIT = 256 << 10
"""A shared stream is closed once its tables hold this many in-memory bytes: restoring one of
its key groups reads and decodes the whole stream."""
HIGH_LEVEL_LIMIT = 256 << 10
"""The small files of a packed file (those under :data:`SHARE_BELOW`) are compressed at zstd's
high level for small tables while they hold at most this many in-memory bytes together, and at
its fast level when they hold more. The high level costs ~1 ms of CPU per 16 KiB (~10x the fast
level) for files ~25 % smaller: worth it for the small deltas it was chosen for (1 % of 1 M keys
changed: ~180 KB), not for a whole state whose key groups each fall under 16 KiB (100 k string
keys in 128 key groups: 1.9 MB, 113 ms of the writer's CPU at every checkpoint; 10 ms at the
fast level, 700 KB instead of 520 KB)."""


class KeyGroupWrite(NamedTuple):
    """One key group's changes for :meth:`SnapshotStore.write_key_groups` (the arguments of
    :meth:`SnapshotStore.write_key_group`)."""

    operator: str
    state: str
    key_group: int
    prev_chain: Sequence[FileRef]
    delta: "pa.Table | Callable[[], pa.Table]"
    complete: bool = False
    image: Callable[[], pa.Table | None] | None = None
    over_base: FileRef | None = None
    values_image: Callable[[], pa.Table | None] | None = None
    """What :func:`~storage.values_images.values_image` makes of the normalized ``delta`` (a
    zero-argument callable), made without building it (the writer of a columnar key group,
    :mod:`abs.runtime.writer`: ~75 us of a key group's ~400 us at each checkpoint)."""
    rows: int | None = None
    """The rows of ``delta`` when known without building it: the write then builds the delta
    only when what it writes needs it (not for a values image, nor for a ``base``)."""
    base: Callable[[], pa.Table | None] | None = None
    """A zero-argument callable giving the delta's rows as a base, made by a writer that knows
    them to be one: upserts of unique keys in ascending order, no ``op`` column (a columnar key
    group's full image, :meth:`abs.state.ColumnDelta.base`), or ``None`` when they are not.
    A checkpoint that writes the key group as a new base then takes it as it is, instead of
    normalizing the delta and folding its rows (~60 us of a small key group's write)."""


@dataclasses.dataclass(frozen=True)
class _Planned:
    """A key group's file to be written: its chain is ``prefix + [the file]``."""

    kind: Literal["base", "delta"]
    encoded: EncodedFile | None  # None: a small file nothing asked the size of, encoded when written
    prefix: list[FileRef]
    table: pa.Table | None = None  # the table as encoded, kept while it may share a stream
    nbytes: int = 0  # the table's in-memory bytes (table_bytes), when it is kept

    @property
    def rows(self) -> int:
        return self.table.num_rows if self.encoded is None else self.encoded.rows  # type: ignore[union-attr]

    @property
    def pack_bytes(self) -> int:
        """What the file adds to its packed file, for :data:`PACK_LIMIT` (a small file not
        encoded yet: its in-memory bytes, more than it will take)."""
        return self.nbytes if self.encoded is None else self.encoded.size  # type: ignore[union-attr]


class _Encoded(NamedTuple):
    encoded: EncodedFile | None  # None: see _encode's sized
    table: pa.Table | None  # kept when small enough to share a stream (see SHARE_BELOW)
    shared_size: int  # its bytes in a shared stream, estimated: without a stream's fixed cost
    nbytes: int = 0  # the kept table's table_bytes


_STREAM_COST: dict[bytes, int] = {}  # serialized schema -> bytes of a stream of one row of it


def _stream_cost(table: pa.Table) -> int:
    """What a stream of ``table``'s schema costs whatever its rows (schema message, a record
    batch header, zstd frames, end of stream: some 700 bytes for a key and a value column),
    measured once per schema as the size of a stream of its first row."""
    schema = table.schema.serialize().to_pybytes()
    cost = _STREAM_COST.get(schema)
    if cost is None:
        if len(_STREAM_COST) > 256:
            _STREAM_COST.clear()
        cost = _STREAM_COST[schema] = encode_prepared(table.slice(0, 1), level=FAST_LEVEL).size
    return cost


def _encode(table: pa.Table, kind: str, share_below: int, *, sized: bool = True) -> _Encoded:
    """``table`` encoded as a file of its own; one small enough to share a stream is encoded
    at zstd's fastest level only, for its size (a few % above what the file's level makes):
    it is encoded again when written, in a shared stream or, if it ends alone, on its own
    (:func:`_final`). Its size in a shared stream (``shared_size``, what the chain decision
    weighs a delta by, as a shared file's reference counts its share of its range) is
    estimated as that size less the fixed cost of a stream (:func:`_stream_cost`).

    ``sized=False``: no decision asks the file's size (a base), and a small one is not encoded
    here at all, only when written: the estimate cost ~0.2 ms per key group, thrown away when
    the file went into a shared stream (every key group of a checkpoint of 100 k string keys)."""
    prepared = prepare_table(table, kind)
    nbytes = table_bytes(prepared)
    if nbytes < share_below and prepared.num_rows:
        if not sized:
            return _Encoded(None, prepared, 0, nbytes)
        encoded = encode_prepared(prepared, level=FAST_LEVEL)
        return _Encoded(encoded, prepared, max(1, encoded.size - _stream_cost(prepared)), nbytes)
    encoded = encode_prepared(prepared, level=compression_level(prepared, nbytes))
    return _Encoded(encoded, None, encoded.size)


def _final(planned: "_Planned", fast: bool = False) -> EncodedFile:
    """The bytes of a planned file written as a stream of its own; ``fast``: a small one at
    zstd's fast level (the bytes :func:`_encode` made for its size, if it made them)."""
    if planned.encoded is not None and (planned.table is None or fast):
        return planned.encoded
    level = FAST_LEVEL if fast else compression_level(planned.table, planned.nbytes)  # type: ignore[arg-type]
    return encode_prepared(planned.table, level=level)  # type: ignore[arg-type]


def _planned(kind: Literal["base", "delta"], encoded: _Encoded, prefix: list[FileRef]) -> _Planned:
    return _Planned(kind, encoded.encoded, prefix, encoded.table, encoded.nbytes)


def _streams(members: list[tuple[int, KeyGroupWrite, _Planned]]) -> list[list[tuple[int, KeyGroupWrite, _Planned]]]:
    """The Arrow streams of a packed file, in the order of their first key group: a key
    group's file alone, or the small tables of one kind and schema (metadata included) in
    key group order, up to :data:`SHARED_RANGE_LIMIT` in-memory bytes per stream."""
    streams: list[list[tuple[int, KeyGroupWrite, _Planned]]] = []
    # the open stream of each (kind, schema): [kind, schema, stream, its bytes]; a few at most,
    # so a list searched with Schema.equals (~0.2 us) rather than keys serialized per table (~3 us)
    open_streams: list[list] = []
    last: list | None = None
    for member in members:
        planned = member[2]
        table = planned.table
        if table is None:
            streams.append([member])
            continue
        schema = table.schema
        current = last if last is not None and last[0] == planned.kind and (
            last[1] is schema or last[1].equals(schema, check_metadata=True)) else next(
            (o for o in open_streams if o[0] == planned.kind and o[1].equals(schema, check_metadata=True)), None)
        if current is None or current[3] + planned.nbytes > SHARED_RANGE_LIMIT:
            if current is not None:
                open_streams.remove(current)
            current = [planned.kind, schema, [], 0]
            open_streams.append(current)
            streams.append(current[2])
        current[2].append(member)
        current[3] += planned.nbytes
        last = current
    return streams


def put_file(io: RootIO, path: str, encoded: EncodedFile, kind: FileKind, checkpoint_id: int) -> FileRef:
    """Write an encoded file at ``path``; returns its reference."""
    ref = FileRef(path=path, kind=kind, checkpoint_id=CheckpointId(checkpoint_id), rows=encoded.rows,
                  bytes=encoded.size, checksum=encoded.checksum, checksum_algorithm=encoded.checksum_algorithm)
    io.put(path, encoded.data)
    return ref


def write_table(io: RootIO, path: str, table: pa.Table, kind: FileKind, checkpoint_id: int) -> FileRef:
    """Encode ``table`` as a file of ``kind`` and write it at ``path``."""
    return put_file(io, path, encode_table(table, kind), kind, checkpoint_id)


def write_operator_state(io: RootIO, checkpoint_id: int, operator: str, subtask: int, table: pa.Table) -> FileRef:
    """:meth:`SnapshotStore.write_operator_state`."""
    if not isinstance(table, pa.Table):
        raise DeltaSchemaError(f"checkpoint {checkpoint_id}: operator state of {operator}[{subtask}] must be a pyarrow.Table")
    path = StoragePaths.opstate_file(checkpoint_id, operator, SubtaskIndex(subtask))
    return write_table(io, path, table, "opstate", checkpoint_id)


def write_channel_log(io: RootIO, checkpoint_id: int, task: str, table: pa.Table) -> FileRef:
    """:meth:`SnapshotStore.write_channel_log`."""
    if not isinstance(table, pa.Table):
        raise DeltaSchemaError(f"checkpoint {checkpoint_id}: channel log of {task} must be a pyarrow.Table")
    return write_table(io, StoragePaths.channel_file(checkpoint_id, task), table, "channel", checkpoint_id)


def _encode_base(delta: pa.Table, share_below: int) -> _Encoded:
    """A delta's live rows encoded as a base. Sorting first makes the usual case (unique
    integer keys) resolve with one vectorized comparison instead of a distinct count."""
    return _encode(resolve_chain([sort_by_key(delta)], first_is_base=False), "base", share_below, sized=False)


@dataclasses.dataclass(frozen=True)
class KeyGroupWriter:
    """Writes key groups into one root.

    ``reader`` reads a chain back when it is compacted; ``check_key_group(key_group, what)``
    refuses a key group outside the root's job; ``share_below``: see :data:`SHARE_BELOW`
    (0: every key group's file is a stream of its own, as in format 5).
    """

    io: RootIO
    reader: ChainReader
    policy: CompactionPolicy
    pack_limit: int
    check_key_group: Callable[[int, str], None]
    share_below: int = SHARE_BELOW

    def write_key_group(self, checkpoint_id: int, job: KeyGroupWrite) -> list[FileRef]:
        """:meth:`SnapshotStore.write_key_group`: the new chain of one key group."""
        planned = self._plan(checkpoint_id, job)
        return planned if isinstance(planned, list) else self._put_single(checkpoint_id, job, planned)

    def write_key_groups(self, checkpoint_id: int, jobs: Sequence[KeyGroupWrite]) -> list[list[FileRef]]:
        """:meth:`SnapshotStore.write_key_groups`: the new chains in job order, the files of
        one (operator, state) packed."""
        jobs = [job if isinstance(job, KeyGroupWrite) else KeyGroupWrite(*job) for job in jobs]
        out: list[list[FileRef] | None] = [None] * len(jobs)
        groups: dict[tuple[str, str], list[int]] = {}
        for i, job in enumerate(jobs):
            groups.setdefault((job.operator, job.state), []).append(i)
        parallel = self.io.object_store and len(jobs) > 1
        pool = ThreadPoolExecutor(_REMOTE_ENCODERS, thread_name_prefix="abs-encode") if parallel else None
        plan = functools.partial(self._plan, checkpoint_id)
        step = _REMOTE_ENCODERS * 2 if parallel else 1
        try:
            for (operator, state), members in groups.items():
                members.sort(key=lambda i: jobs[i].key_group)
                pack: list[tuple[int, KeyGroupWrite, _Planned]] = []
                size = 0
                for at in range(0, len(members), step):
                    batch = members[at:at + step]
                    planned = list(pool.map(plan, [jobs[i] for i in batch])) if pool else [plan(jobs[batch[0]])]
                    for i, p in zip(batch, planned):
                        if isinstance(p, list):
                            out[i] = p
                            continue
                        pack.append((i, jobs[i], p))
                        size += p.pack_bytes
                        if size >= self.pack_limit:
                            self._put_pack(checkpoint_id, operator, state, pack, out)
                            pack, size = [], 0
                if pack:
                    self._put_pack(checkpoint_id, operator, state, pack, out)
        finally:
            if pool is not None:
                pool.shutdown(wait=True)
        return out  # type: ignore[return-value]

    def _put_single(self, checkpoint_id: int, job: KeyGroupWrite, planned: _Planned) -> list[FileRef]:
        path = StoragePaths.state_file(checkpoint_id, job.operator, job.state, job.key_group, planned.kind)
        return planned.prefix + [put_file(self.io, path, _final(planned), planned.kind, checkpoint_id)]

    def _put_pack(self, checkpoint_id: int, operator: str, state: str,
                  members: list[tuple[int, KeyGroupWrite, _Planned]], out: list) -> None:
        if len(members) == 1:
            i, job, planned = members[0]
            out[i] = self._put_single(checkpoint_id, job, planned)
            return
        path = StoragePaths.packed_file(checkpoint_id, operator, state)
        parts: list[bytes] = []
        offset = 0
        fast = sum(p.nbytes for _, _, p in members if p.table is not None) > HIGH_LEVEL_LIMIT

        def ref(planned: _Planned, key_group: int, encoded: EncodedFile, size: int, **shared: int) -> FileRef:
            return FileRef(path=path, kind=planned.kind, checkpoint_id=CheckpointId(checkpoint_id),
                           rows=planned.rows, bytes=size, checksum=encoded.checksum,
                           checksum_algorithm=encoded.checksum_algorithm, offset=offset, key_group=key_group, **shared)

        for stream in _streams(members):
            if len(stream) == 1:
                i, job, planned = stream[0]
                encoded = _final(planned, fast)
                out[i] = planned.prefix + [ref(planned, job.key_group, encoded, encoded.size)]
            else:
                encoded = encode_shared([planned.table for _, _, planned in stream],  # type: ignore[misc]
                                        **({"level": FAST_LEVEL} if fast else {}))
                # the whole range, checked once; each key group's rows of it derived from it
                # (FileRef.in_range checks only what differs: ~10 us less a key group)
                whole = FileRef(path=path, kind=stream[0][2].kind, checkpoint_id=CheckpointId(checkpoint_id),
                                rows=encoded.rows, bytes=encoded.size, checksum=encoded.checksum,
                                checksum_algorithm=encoded.checksum_algorithm, offset=offset,
                                key_group=stream[0][1].key_group)
                row = 0
                for i, job, planned in stream:
                    end = row + planned.rows
                    # the key group's share of the range's bytes: by rows, adding up to the range exactly
                    share = encoded.size * end // encoded.rows - encoded.size * row // encoded.rows
                    out[i] = planned.prefix + [whole.in_range(job.key_group, row_offset=row, rows=planned.rows,
                                                              share=share)]
                    row = end
            parts.append(encoded.data)
            offset += encoded.size
        self.io.put(path, b"".join(parts))

    def _plan(self, checkpoint_id: int, job: KeyGroupWrite) -> list[FileRef] | _Planned:
        """What :meth:`write_key_group` writes for ``job``: the new chain when nothing is to be
        written, else the encoded file and the part of the old chain it extends."""
        operator, state, key_group, prev_chain, delta = job[:5]
        what = f"checkpoint {checkpoint_id}: {operator}/{state} key group {key_group}"
        made: list[pa.Table] = []

        def table() -> pa.Table:
            """The normalized delta, built on the first call."""
            if not made:
                made.append(normalize_delta(delta() if callable(delta) else delta, what=what))
            return made[0]

        rows = job.rows if job.rows is not None else table().num_rows
        self.check_key_group(key_group, what)
        chain = list(prev_chain)
        if chain:
            problems = chain_problems(chain, operator=operator, state=state, key_group=key_group,
                                      max_checkpoint_id=checkpoint_id)
            if problems:
                raise InvalidChainError(
                    f"{what}: the previous chain is malformed ({problems[0][1]}); refusing to extend it; "
                    "pass the chain returned by the previous write_key_group or the last complete manifest"
                )
        return self._carry_out(what, chain, job, table, rows)

    def _carry_out(self, what: str, chain: list[FileRef], job: KeyGroupWrite,
                   table: Callable[[], pa.Table], rows: int) -> list[FileRef] | _Planned:
        """Learn the facts :func:`decide_chain` asks for (encoding, calling the writer's image),
        then encode what it decides; the encoded files it asked about are reused. ``table()``:
        the normalized delta (of ``rows`` rows), built when first needed."""
        facts = CaptureFacts(rows=rows, complete=job.complete, over_base=job.over_base is not None,
                             has_image=job.image is not None)
        encoded: dict[Fact, _Encoded | None] = {}
        full: pa.Table | None = None
        while True:
            decision = decide_chain(self.policy, ChainFacts.of(chain, job.over_base), facts)
            if isinstance(decision, ChainDecision):
                break
            fact = decision.fact
            if fact is Fact.VALUES_IMAGE:
                values = job.values_image() if job.values_image is not None else values_image(table())
                encoded[fact] = None if values is None else _encode(values, "delta", self.share_below)
                facts = facts.learn(fact, None if values is None else encoded[fact].encoded.size)  # type: ignore[union-attr]
            elif fact is Fact.DELTA_BYTES:
                encoded[fact] = _encode(delta_for_file(table()), "delta", self.share_below)
                facts = facts.learn(fact, encoded[fact].shared_size)  # type: ignore[union-attr]
            else:  # asked for only when the writer has an image
                full = job.image() if job.image is not None else None
                facts = facts.learn(fact, full is not None)
        action = decision.action
        if action is ChainAction.KEEP:
            return chain
        if action is ChainAction.DROP:
            return []  # a full image without rows: the key group holds no state any more
        prefix = chain[:decision.keep]
        if action is ChainAction.VALUES_IMAGE:
            return _planned("delta", encoded[Fact.VALUES_IMAGE], prefix)  # type: ignore[arg-type]
        if action is ChainAction.DELTA:
            return _planned("delta", encoded[Fact.DELTA_BYTES], prefix)  # type: ignore[arg-type]
        if action is ChainAction.BASE:
            made_base = job.base() if job.base is not None else None
            if made_base is not None:
                return _planned("base", _encode(made_base, "base", self.share_below, sized=False), prefix)
            return _planned("base", _encode_base(table(), self.share_below), prefix)
        if action is ChainAction.COMPACT_FROM_IMAGE:  # decided only once the image exists
            full = normalize_delta(full, what=f"{what} (full image)")  # type: ignore[arg-type]
            return _planned("base", _encode_base(full, self.share_below), prefix)
        tables = self.reader.read_files(chain) + [table()]
        try:
            base = resolve_chain(tables, first_is_base=True)
        except DeltaSchemaError as exc:
            raise DeltaSchemaError(f"{what}: {exc}") from exc
        return _planned("base", _encode(base, "base", self.share_below, sized=False), prefix)
