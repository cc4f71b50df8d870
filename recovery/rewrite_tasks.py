"""The work of one offline-rewrite task, on an engine's worker: compact a run of key groups
into bases (:func:`compact_group`), or re-key it in two stages, hashing every live key into
the new key groups (:func:`split_group`) and writing each new key group's base from the rows
it received (:func:`write_rekeyed`); rows travel between the stages as Arrow IPC
(:func:`to_ipc`, :func:`from_ipc`)."""
from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from abscore.keygroups import stable_hashes
from abscore.schema import ENCODING_ARROW, ENCODING_PICKLE, KEY_COLUMN, META_KEY_ENCODING, META_VALUE_ENCODING
from storage import FileRef, SnapshotStore, StoragePaths
from storage.format import is_pickled
from storage.savepoint import write_savepoint_pack

from .errors import RewriteError, UnpickleRefusedError
from .rewrite_plan import KeyGroupTask, RewriteContext, _pickled_keys_refusal

if TYPE_CHECKING:  # pragma: no cover
    from numpy.typing import NDArray

__all__ = [
    "compact_group",
    "split_group",
    "write_rekeyed",
    "to_ipc",
    "from_ipc",
]

_KEY_PICKLE_PROTOCOL = 5  # what abs.state pickles keys with ("pickle protocol 5")
_SHUFFLE_CODEC = "lz4" if pa.Codec.is_available("lz4") else None
_SHUFFLE_WRITE = pa.ipc.IpcWriteOptions(compression=_SHUFFLE_CODEC)


def _source_store(ctx: RewriteContext) -> SnapshotStore:
    from storage.spark_stores import _open_store  # one cached store per Python worker (read only)

    store = _open_store(ctx.root, ctx.storage_options, cached=True)
    if store.decode_limits != ctx.decode_limits:  # the cached store's file system, this rewrite's limits
        store = SnapshotStore(store._io, policy=store.policy, decode_limits=ctx.decode_limits)
    return store


def _dest_store(ctx: RewriteContext) -> SnapshotStore:
    # opened per task, not cached: a cached store remembers the directories it created
    return SnapshotStore.open(ctx.dest, ctx.dest_storage_options, check=False)


def _write_base(dest: SnapshotStore, ctx: RewriteContext, operator: str, state: str, key_group: int,
                table: pa.Table) -> FileRef:
    sp = ctx.savepoint_id
    return dest._write_table(StoragePaths.state_file(sp, operator, state, key_group, "base"), table, "base", sp)


def compact_group(ctx: RewriteContext, group: Iterable[Sequence[KeyGroupTask]]) -> Iterator[tuple[str, str, int, FileRef]]:
    """Resolve each chain of ``group`` (whole savepoint packs, :func:`recovery.rewrite_plan.group_packs`)
    and write it as one base of the savepoint, each pack packed exactly as
    :func:`storage.savepoint.take_savepoint` packs it (the same bytes per key group). A key
    group whose keys were all deleted gets an empty base, as in :func:`take_savepoint`."""
    source, dest = _source_store(ctx), _dest_store(ctx)
    for pack in group:
        items = [(task.operator, task.state, task.key_group, task.chain) for task in pack]
        for operator, state, key_group, chain in write_savepoint_pack(source, ctx.checkpoint_id, dest,
                                                                       ctx.savepoint_id, items):
            yield operator, state, key_group, chain[0]


def _where(ctx: RewriteContext, operator: str, state: str, key_group: int) -> str:
    return f"{ctx.root}: checkpoint {ctx.checkpoint_id}: {operator}/{state} key group {key_group}"


def _python_keys(table: pa.Table, where: str) -> list[Any]:
    """Unpickle a pickled key column (only ever inside a task)."""
    try:
        return [pickle.loads(b) for b in table.column(KEY_COLUMN).to_pylist()]
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means the same thing
        raise RewriteError(
            f"{where}: a pickled key does not unpickle here ({type(exc).__name__}: {exc}); re-key where the "
            "classes of the keys can be imported (same code and Python as the job)"
        ) from exc


def _hashes(table: pa.Table, where: str, *, unpickle: bool = False) -> "NDArray[np.uint64]":
    """The runtime's stable hash of every key: vectorized for typed keys, per unpickled key
    for pickled ones (only with ``unpickle``; :class:`UnpickleRefusedError` without)."""
    pickled = is_pickled(table.schema, KEY_COLUMN)
    if pickled and not unpickle:
        raise UnpickleRefusedError(
            f"{where}: the keys are pickled; re-keying must unpickle them, which runs code from the snapshot; "
            "pass --unpickle (unpickle=True) if you trust this root"
        )
    keys: Any = _python_keys(table, where) if pickled else table.column(KEY_COLUMN)
    try:
        return stable_hashes(keys)
    except (TypeError, ValueError) as exc:
        raise RewriteError(f"{where}: the keys cannot be hashed ({exc}); they were not written by the runtime") from exc


def _check_placement(hashes: "NDArray[np.uint64]", table: pa.Table, ctx: RewriteContext, task: KeyGroupTask) -> None:
    old = hashes % np.uint64(ctx.old_max_parallelism)
    wrong = np.flatnonzero(old != np.uint64(task.key_group))
    if wrong.size:
        key = table.column(KEY_COLUMN)[int(wrong[0])].as_py()
        if is_pickled(table.schema, KEY_COLUMN):
            key = pickle.loads(key)
        raise RewriteError(
            f"{_where(ctx, task.operator, task.state, task.key_group)}: {wrong.size} key(s) do not belong there, "
            f"e.g. key {key!r} hashes to key group {int(old[wrong[0]])} of max_parallelism {ctx.old_max_parallelism}; "
            "the snapshot is corrupt or was written with another key hash; refusing to re-key it"
        )


def _split_by(table: pa.Table, groups: "NDArray[np.int64]") -> Iterator[tuple[int, pa.Table]]:
    """``(group, rows of that group)`` for every distinct value of ``groups`` (one row each)."""
    order = np.argsort(groups, kind="stable")
    ordered = groups[order]
    starts = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))
    ends = np.append(starts[1:], len(ordered))
    taken = table.take(pa.array(order))
    for start, end in zip(starts.tolist(), ends.tolist()):
        yield int(ordered[start]), taken.slice(start, end - start)


def to_ipc(table: pa.Table) -> bytes:
    """An Arrow IPC stream (lz4 buffers): how rows travel through a Spark shuffle."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=_SHUFFLE_WRITE) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def from_ipc(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(pa.BufferReader(data)).read_all()


def split_group(ctx: RewriteContext, group: Iterable[KeyGroupTask]) -> Iterator[tuple[tuple[str, str, int], pa.Table]]:
    """Re-key stage 1: resolve each chain (deletes applied), check that every key belongs to
    its old key group, hash it into the new key groups and yield ``((operator, state, new key
    group), those rows)``."""
    source = _source_store(ctx)
    for task in group:
        table = source.read_chain(list(task.chain), checkpoint_id=ctx.checkpoint_id)
        if table.num_rows == 0:
            continue
        if not ctx.unpickle and is_pickled(table.schema, KEY_COLUMN):
            raise _pickled_keys_refusal(ctx, task.operator, task.state)
        hashes = _hashes(table, _where(ctx, task.operator, task.state, task.key_group), unpickle=ctx.unpickle)
        _check_placement(hashes, table, ctx, task)
        new = (hashes % np.uint64(ctx.new_max_parallelism)).astype(np.int64)
        for kg, part in _split_by(table, new):
            yield (task.operator, task.state, kg), part


def _pickle_keys(table: pa.Table) -> pa.Table:
    if is_pickled(table.schema, KEY_COLUMN):
        return table
    blobs = [pickle.dumps(k, _KEY_PICKLE_PROTOCOL) for k in table.column(KEY_COLUMN).to_pylist()]
    meta = dict(table.schema.metadata or {})
    meta[META_KEY_ENCODING] = ENCODING_PICKLE
    index = table.schema.get_field_index(KEY_COLUMN)
    out = table.set_column(index, pa.field(KEY_COLUMN, pa.binary(), nullable=False), pa.array(blobs, pa.binary()))
    return out.replace_schema_metadata(meta)


def _merge_parts(parts: list[pa.Table], where: str) -> pa.Table:
    """Rows of one new key group from several old ones. Key groups whose keys were stored with
    different Arrow types (or some pickled) are merged with pickled keys, exactly as the
    runtime encodes a key group holding keys of several types."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0].schema
    if all(p.schema.equals(first, check_metadata=True) for p in parts[1:]):
        return pa.concat_tables(parts)
    value_encodings = {(p.schema.metadata or {}).get(META_VALUE_ENCODING, ENCODING_ARROW) for p in parts}
    if len(value_encodings) > 1:
        raise RewriteError(f"{where}: the old key groups store the values with different encodings "
                           f"({sorted(e.decode() for e in value_encodings)}); cannot merge them into one key group")
    key_types = {p.schema.field(KEY_COLUMN).type for p in parts}
    if len(key_types) > 1 or any(is_pickled(p.schema, KEY_COLUMN) for p in parts):
        parts = [_pickle_keys(p) for p in parts]
    meta = parts[0].schema.metadata
    parts = [p.replace_schema_metadata(meta) for p in parts]
    try:
        return pa.concat_tables(parts, promote_options="default")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise RewriteError(f"{where}: the old key groups have incompatible schemas ({exc}); "
                           "cannot merge them into one key group") from exc


def write_rekeyed(ctx: RewriteContext, target: tuple[str, str, int], parts: Iterable[pa.Table]
                  ) -> tuple[str, str, int, FileRef]:
    """Re-key stage 2: merge the rows of one new key group (from any old ones) and write its base."""
    operator, state, kg = target
    where = f"{ctx.dest}: savepoint {ctx.savepoint_id}: {operator}/{state} new key group {kg}"
    table = _merge_parts(list(parts), where)
    if pc.count_distinct(table.column(KEY_COLUMN)).as_py() != table.num_rows:
        raise RewriteError(f"{where}: a key occurs in two old key groups; the source snapshot is corrupt; "
                           "refusing to write the savepoint")
    return operator, state, kg, _write_base(_dest_store(ctx), ctx, operator, state, kg, table)
