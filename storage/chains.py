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
from .format import KEY_COLUMN, META_FILE_KIND, OP_COLUMN, OP_UPSERT
from .manifest import FileRef

__all__ = ["CompactionPolicy", "compaction_reason", "resolve_chain"]

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
    if not prev_chain:
        return None
    length = len(prev_chain) + 1
    if length > policy.max_chain_length:
        return f"chain length {length} > {policy.max_chain_length}"
    base_bytes = max(prev_chain[0].bytes, 1)
    delta_bytes = sum(ref.bytes for ref in prev_chain[1:]) + new_delta_bytes
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
    return meta or None


def _last_per_key(deltas: pa.Table) -> pa.Table:
    """Rows of ``deltas`` that are the last occurrence of their key (vectorized)."""
    keys = deltas.column(KEY_COLUMN)
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


def resolve_chain(tables: Sequence[pa.Table], *, first_is_base: bool) -> pa.Table:
    """Fold tables (oldest first) into live state: one row per live key, columns ``key`` and
    the value columns, no ``op``. The last op per key wins; a delete drops the key.

    With ``first_is_base`` the first table is a base (unique keys, no deletes). Keys compare
    by their Arrow value (pickled keys by bytes). Schema metadata comes from the newest table.
    """
    if not tables:
        raise ValueError("resolve_chain needs at least one table")
    metadata = _clean_metadata(tables[-1].schema)
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
    if with_ops:
        upserts = last.filter(pc.equal(last.column(OP_COLUMN), OP_UPSERT)).drop_columns([OP_COLUMN])
    else:
        upserts = last
    if base is None:
        return upserts.replace_schema_metadata(metadata)
    changed = last.column(KEY_COLUMN)
    try:
        kept = base.filter(pc.invert(pc.is_in(base.column(KEY_COLUMN), value_set=changed)))
        if sorted(kept.schema.names) != sorted(upserts.schema.names):
            raise pa.ArrowInvalid(f"base columns {kept.schema.names} differ from delta columns {upserts.schema.names}")
        upserts = upserts.select(kept.schema.names)
        merged = pa.concat_tables([kept, upserts], promote_options="default")
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
        raise DeltaSchemaError(f"a delta does not match its base ({exc}); keep one schema per state") from exc
    return merged.replace_schema_metadata(metadata)

