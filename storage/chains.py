"""Chains of state files: resolving a base plus deltas into live state, and the compaction rule.

Pure functions over Arrow tables and file references; no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .errors import DeltaSchemaError
from .format import (CHECKSUM_ALGORITHMS, KEY_COLUMN, META_FILE_KIND, META_KEYS_DIGEST, OP_COLUMN, OP_UPSERT,
                     is_values_image, keys_digest, strictly_increasing, value_columns)
from .manifest import FileRef
from .tables import SMALL_TEXT_ROWS, is_text
from .values_images import join_byte_streams

__all__ = ["CompactionPolicy", "compaction_reason", "compaction_reason_of_sizes", "resolve_chain"]

_SEQ = "__abs_seq"


@dataclass(frozen=True)
class CompactionPolicy:
    """When :meth:`SnapshotStore.write_key_group` folds a chain into a new base.

    Compact when the chain *after* appending the new delta would be longer than
    ``max_chain_length`` files (base included), or when the bytes of all its deltas exceed
    ``max_delta_ratio`` times the bytes of its base. Restore reads at most
    ``max_chain_length`` files per key group and stores at most ``1 + max_delta_ratio``
    times the base size.
    """

    max_chain_length: int = 10
    max_delta_ratio: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.max_chain_length, int) or self.max_chain_length < 1:
            raise ValueError(f"CompactionPolicy.max_chain_length={self.max_chain_length!r}: must be an integer >= 1")
        if not self.max_delta_ratio >= 0:
            raise ValueError(f"CompactionPolicy.max_delta_ratio={self.max_delta_ratio!r}: must be >= 0")


def compaction_reason(policy: CompactionPolicy, prev_chain: Sequence[FileRef], new_delta_bytes: int) -> str | None:
    """Why the chain ``prev_chain + [new delta]`` must be compacted, or ``None`` to append.

    An empty ``prev_chain`` is not a compaction: the delta becomes the first base.
    """
    return compaction_reason_of_sizes(policy, [ref.bytes for ref in prev_chain], new_delta_bytes)


def compaction_reason_of_sizes(policy: CompactionPolicy, file_bytes: Sequence[int], new_delta_bytes: int) -> str | None:
    """:func:`compaction_reason` over the byte sizes of the chain's files (base first)."""
    if not file_bytes:
        return None
    length = len(file_bytes) + 1
    if length > policy.max_chain_length:
        return f"chain length {length} > {policy.max_chain_length}"
    base_bytes = max(file_bytes[0], 1)
    delta_bytes = sum(file_bytes[1:]) + new_delta_bytes
    ratio = delta_bytes / base_bytes
    if ratio > policy.max_delta_ratio:
        return f"delta/base bytes {ratio:.2f} > {policy.max_delta_ratio}"
    return None


def _with_op(table: pa.Table) -> pa.Table:
    if OP_COLUMN in table.schema.names:
        return table
    return table.append_column(OP_COLUMN, pa.array(np.full(table.num_rows, OP_UPSERT, dtype=np.int8)))


def _clean_metadata(schema: pa.Schema) -> dict[bytes, bytes] | None:
    meta = dict(schema.metadata or {})
    meta.pop(META_FILE_KIND, None)
    meta.pop(META_KEYS_DIGEST, None)
    return meta or None


def _int_keys(keys: pa.ChunkedArray | pa.Array) -> np.ndarray | None:
    """Integer keys as a numpy array (zero-copy for one chunk), else ``None`` (also with nulls,
    which keys never have)."""
    if not pa.types.is_integer(keys.type) or keys.null_count:
        return None
    return keys.to_numpy()


def _has_deletes(ops: pa.ChunkedArray | pa.Array) -> bool:
    """:func:`storage.format.has_deletes` with ``count_nonzero`` instead of ``any()``: a numpy
    reduction goes through numpy's Python-level wrappers (~8 us for 78 values in isolation,
    measured several times that inside a restore), ``count_nonzero`` is one C call (~1.6 us)."""
    return bool(np.count_nonzero(ops.to_numpy() != OP_UPSERT))


def _text_strictly_increasing(keys: pa.ChunkedArray | pa.Array) -> bool:
    """Whether string or binary ``keys`` in one chunk (one sorted table: a writer's delta or
    image; several deltas of a chain come in several chunks and are not asked) strictly
    increase. Every key group of a checkpoint of string keys goes through here when it is
    written as a base: a distinct count cost ~3x this comparison."""
    if isinstance(keys, pa.ChunkedArray):
        if keys.num_chunks != 1:
            return False
        keys = keys.chunk(0)
    if keys.null_count or not is_text(keys.type):
        return False
    if len(keys) < 2:
        return True
    if len(keys) <= SMALL_TEXT_ROWS:
        k = keys.to_pylist()
        return all(a < b for a, b in zip(k, k[1:]))
    return bool(pc.all(pc.less(keys.slice(0, len(keys) - 1), keys.slice(1))).as_py())


def _last_per_key(deltas: pa.Table) -> pa.Table:
    """Rows of ``deltas`` that are the last occurrence of their key (vectorized)."""
    keys = deltas.column(KEY_COLUMN)
    ints = _int_keys(keys)
    if ints is not None and strictly_increasing(ints):
        return deltas  # strictly increasing keys (one delta file, sorted on write): every key once
    if ints is None and _text_strictly_increasing(keys):
        return deltas  # the same for string or binary keys: one comparison, a third of a distinct count
    try:
        if pc.count_distinct(keys).as_py() == deltas.num_rows:
            return deltas  # every key once: nothing to fold (the common case, and 10x cheaper)
    except pa.ArrowNotImplementedError:
        pass  # fall through to group_by, which reports unsupported key types
    seq = pa.array(np.arange(deltas.num_rows, dtype=np.int64))
    numbered = pa.table({KEY_COLUMN: keys, _SEQ: seq})
    try:
        last = numbered.group_by(KEY_COLUMN, use_threads=False).aggregate([(_SEQ, "max")])
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid) as exc:
        raise DeltaSchemaError(
            f"keys of type {deltas.schema.field(KEY_COLUMN).type} cannot be grouped ({exc}); "
            "use a primitive, string or binary (pickled) key column"
        ) from exc
    return deltas.take(last.column(f"{_SEQ}_max"))


# Dropping r rows of an n-row base: r+1 zero-copy batch slices (~1 us each) are cheaper than
# filter(), which copies every kept value (~0.3 ms per MB), while r stays below ~n/64.
_SLICE_ROWS_PER_CUT = 64


def _rows_of_keys(base: pa.Table, changed: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Sorted positions of the rows of ``base`` whose key is in ``changed`` (base keys are
    unique). Binary search when both are integer keys and the base is sorted (bases are
    written sorted), a hash lookup otherwise."""
    keys = base.column(KEY_COLUMN)
    base_ints = _int_keys(keys)
    if base_ints is not None and len(base_ints) and changed.type == keys.type and strictly_increasing(base_ints):
        wanted = _int_keys(changed)
        assert wanted is not None
        at = np.searchsorted(base_ints, wanted)
        # a key past the last base key lands on the last row, whose key is smaller
        found = base_ints[np.minimum(at, len(base_ints) - 1)] == wanted
        return np.sort(at[found])
    mask = pc.is_in(keys, value_set=changed)
    return np.flatnonzero(mask.to_numpy(zero_copy_only=False))


def _kept_batches(table: pa.Table, rows: np.ndarray) -> list[pa.RecordBatch] | None:
    """The batches of ``table`` minus the rows at the sorted, unique positions ``rows``, as
    zero-copy slices; ``None`` when so many rows go that copying the rest is cheaper."""
    if len(rows) * _SLICE_ROWS_PER_CUT > table.num_rows:
        return None
    # a plain loop over Python ints: for the ~80 cuts of a key group ~30 us less than the
    # numpy calls that computed the runs per batch (measured)
    pieces: list[pa.RecordBatch] = []
    cuts = iter(rows.tolist())
    cut = next(cuts, None)
    offset = 0
    for batch in table.to_batches():
        end = offset + batch.num_rows
        start = offset  # first row of the kept run being collected
        while cut is not None and cut < end:
            if cut > start:
                pieces.append(batch.slice(start - offset, cut - start))
            start = cut + 1
            cut = next(cuts, None)
        if end > start:
            pieces.append(batch.slice(start - offset, end - start))
        offset = end
    return pieces


def _replace_rows(base: pa.Table, rows: np.ndarray, upserts: pa.Table,
                  metadata: dict[bytes, bytes] | None) -> pa.Table:
    """``base`` without the rows at positions ``rows``, then ``upserts`` (same column order),
    with schema metadata ``metadata``. Zero-copy when few rows go and the types match."""
    schema = base.schema
    if schema.metadata != metadata:  # files of a chain share it, and converting it costs ~8 us
        schema = schema.with_metadata(metadata) if metadata else schema.remove_metadata()
    pieces = _kept_batches(base, rows)
    if pieces is not None:
        try:
            return pa.Table.from_batches(pieces + upserts.to_batches(), schema=schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            pass  # the delta's types differ (e.g. an all-null column): concatenate with promotion
        kept = pa.Table.from_batches(pieces, schema=base.schema)
    else:
        keep = np.ones(base.num_rows, dtype=bool)
        keep[rows] = False
        kept = base.filter(pa.array(keep))
    return pa.concat_tables([kept, upserts], promote_options="default").replace_schema_metadata(metadata)


def _resolve_sorted_pair(base: pa.Table, delta: pa.Table, metadata: dict[bytes, bytes] | None) -> pa.Table | None:
    """``resolve_chain([base, delta], first_is_base=True)`` for the common restore case: integer
    keys strictly increasing in both tables (as format 2 writes them), the base's columns in
    the same order in the delta, ``op`` last or absent. Same result as the general path with
    fewer Arrow and numpy calls, each of which costs several times more inside a restore than
    in a micro-benchmark: ~20 % less time than the general path (measured). ``None`` when the
    pair has another shape or its types do not concatenate: the general path resolves it or
    names the problem."""
    names = base.schema.names
    delta_names = delta.schema.names
    with_op = delta_names[-1:] == [OP_COLUMN]
    if OP_COLUMN in names or delta_names[:len(delta_names) - with_op] != names:
        return None
    keys, changed = base.column(KEY_COLUMN), delta.column(KEY_COLUMN)
    base_ints, delta_ints = _int_keys(keys), _int_keys(changed)
    if base_ints is None or delta_ints is None or not len(base_ints) or not keys.type.equals(changed.type):
        return None
    if not (strictly_increasing(delta_ints) and strictly_increasing(base_ints)):
        return None  # repeated delta keys, or a base of an older writer: the general path
    at = np.searchsorted(base_ints, delta_ints)
    # sorted and unique, as both key columns strictly increase; a key past the last base key
    # lands on the last row, whose key is smaller
    rows = at[base_ints[np.minimum(at, len(base_ints) - 1)] == delta_ints]
    upserts = delta
    if with_op:
        ops = delta.column(len(names))
        upserts = delta.remove_column(len(names))
        if _has_deletes(ops):
            upserts = upserts.filter(pc.equal(ops, OP_UPSERT))
    try:
        return _replace_rows(base, rows, upserts, metadata)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        return None  # the general path fails the same way and raises DeltaSchemaError


def _apply_values_image(base: pa.Table, image: pa.Table, base_schema: pa.Schema | None) -> pa.Table:
    """The base with the values of a values image (format 4): row ``i`` of the image holds the
    values of the base's row ``i``. Checks that the image was written for these very keys and
    columns. ``base`` may hold its key column alone (:meth:`SnapshotStore.read_chain` does not
    decode the values a values image replaces); ``base_schema`` is then its file's schema."""
    base_values = value_columns(base_schema if base_schema is not None else base.schema)
    try:
        image = join_byte_streams(image)  # format 8: columns stored byte-stream split
    except ValueError as exc:
        raise DeltaSchemaError(f"a values image is unreadable: {exc}; the chain or its manifest is corrupt") from exc
    digest = (image.schema.metadata or {}).get(META_KEYS_DIGEST, b"").decode(errors="replace")
    algorithm = digest.partition(":")[0]
    problem = None
    if OP_COLUMN in base.schema.names:
        problem = "its base has an 'op' column"
    elif image.num_rows != base.num_rows:
        problem = f"it has {image.num_rows} rows and its base {base.num_rows}"
    elif sorted(base_values) != sorted(image.schema.names):
        problem = f"its columns {image.schema.names} are not the base's value columns {base_values}"
    else:
        actual = keys_digest(base.column(KEY_COLUMN), algorithm) if algorithm in CHECKSUM_ALGORITHMS else None
        if actual is None or actual != digest:
            problem = f"it was written for other keys than its base's (keys digest {digest or 'absent'!r})"
    if problem is not None:
        raise DeltaSchemaError(f"a values image does not fit its base: {problem}; the chain or its manifest is corrupt")
    columns = [base.column(KEY_COLUMN)] + [image.column(name) for name in base_values]
    return pa.Table.from_arrays(columns, names=[KEY_COLUMN, *base_values]).replace_schema_metadata(base.schema.metadata)


def resolve_chain(tables: Sequence[pa.Table], *, first_is_base: bool, base_schema: pa.Schema | None = None) -> pa.Table:
    """Fold tables (oldest first) into live state: one row per live key, columns ``key`` and
    the value columns, no ``op``. The last op per key wins; a delete drops the key.

    With ``first_is_base`` the first table is a base (unique keys, no deletes), and the second
    may be a *values image* (format 4: no ``key`` column, the values of the base's rows, see
    :func:`storage.format.values_image`). Keys compare by their Arrow value (pickled keys by
    bytes). Schema metadata comes from the newest table. ``base_schema``: the schema of the
    base's file when the base was decoded with fewer columns (its keys alone under a values
    image): the image's columns are checked against it, and the result has its column order.
    """
    if not tables:
        raise ValueError("resolve_chain needs at least one table")
    metadata = _clean_metadata(tables[-1].schema)
    for i, t in enumerate(tables):
        if is_values_image(t) and not (first_is_base and i == 1):
            raise DeltaSchemaError(
                f"file {i + 1} of the chain has no 'key' column: only a values image may, and only directly "
                "after its chain's base; the chain or its manifest is corrupt"
            )
    if first_is_base and len(tables) > 1 and is_values_image(tables[1]):
        tables = [_apply_values_image(tables[0], tables[1], base_schema), *tables[2:]]
    if first_is_base and len(tables) == 2:  # a base and one delta: most key groups on restore
        resolved = _resolve_sorted_pair(tables[0], tables[1], metadata)
        if resolved is not None:
            return resolved
    base: pa.Table | None = None
    rest = list(tables)
    if first_is_base:
        base = rest.pop(0)
        if OP_COLUMN in base.schema.names:
            base = base.filter(pc.equal(base.column(OP_COLUMN), OP_UPSERT)).drop_columns([OP_COLUMN])
    if not rest:
        assert base is not None
        return base.replace_schema_metadata(metadata)
    with_ops = any(OP_COLUMN in t.schema.names for t in rest)  # deltas of upserts only omit op
    try:
        if len(rest) == 1:
            deltas = rest[0]
        else:
            deltas = pa.concat_tables([_with_op(t) if with_ops else t for t in rest], promote_options="default")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise DeltaSchemaError(f"the deltas of a chain have incompatible schemas ({exc}); keep one schema per state") from exc
    last = _last_per_key(deltas)
    upserts = last
    if with_ops:
        ops = last.column(OP_COLUMN)
        upserts = last.drop_columns([OP_COLUMN])
        if _has_deletes(ops):
            upserts = upserts.filter(pc.equal(ops, OP_UPSERT))
    if base is None:
        return upserts.replace_schema_metadata(metadata)
    changed = last.column(KEY_COLUMN)
    names = base.schema.names
    try:
        if upserts.schema.names != names:  # files of one state share the column order
            if sorted(names) != sorted(upserts.schema.names):
                raise pa.ArrowInvalid(f"base columns {names} differ from delta columns {upserts.schema.names}")
            upserts = upserts.select(names)
        return _replace_rows(base, _rows_of_keys(base, changed), upserts, metadata)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
        raise DeltaSchemaError(f"a delta does not match its base ({exc}); keep one schema per state") from exc

