"""State tables: what the columns and rows of a keyed state's table mean.

Schema conventions (see ``storage/FORMAT.md``):

- column ``key``: typed Arrow keys, or binary pickled keys when the schema metadata says
  ``abs.key_encoding = pickle`` (absent means ``arrow``);
- every other column except ``op`` is a value column (``abs.value_encoding`` likewise);
- deltas carry ``op`` (int8: 0 upsert, 1 delete) unless every row is an upsert (an all-zero
  column carries no information and costs ~200 bytes per small file); bases carry no ``op``;
- rows of base and delta files are sorted by key where the key type sorts (:func:`sort_by_key`).
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from abscore.schema import (
    ENCODING_PICKLE,
    KEY_COLUMN,
    META_KEY_ENCODING,
    META_VALUE_ENCODING,
    OP_COLUMN,
    OP_DELETE,
    OP_UPSERT,
)

from .errors import DeltaSchemaError

__all__ = [
    "sort_by_key",
    "is_pickled",
    "value_columns",
    "normalize_delta",
    "has_deletes",
    "delta_for_file",
]


SMALL_TEXT_ROWS = 64
"""String or binary keys of at most this many rows are compared as Python objects: a compute
call costs ~5-10 us whatever its length, which was most of a small key group's write (max
parallelism 32768: a few keys a key group). ``str`` compares by code point and UTF-8 keeps
that order, ``bytes`` byte by byte: Arrow's order of the same keys."""


def is_text(t: pa.DataType) -> bool:
    """Whether ``t`` is a string or binary type (large ones too)."""
    return pa.types.is_string(t) or pa.types.is_binary(t) or pa.types.is_large_string(t) or pa.types.is_large_binary(t)


def _keys_sorted(keys: pa.ChunkedArray) -> bool:
    """True when ``keys`` is in non-decreasing order (False when unsure)."""
    if pa.types.is_integer(keys.type):
        k = keys.to_numpy()
        return bool(np.all(k[1:] >= k[:-1]))
    if len(keys) <= SMALL_TEXT_ROWS and is_text(keys.type):
        k = keys.to_pylist()
        return all(a <= b for a, b in zip(k, k[1:]))
    return bool(pc.all(pc.less_equal(keys.slice(0, len(keys) - 1), keys.slice(1))).as_py())


def sort_by_key(table: pa.Table) -> pa.Table:
    """``table`` with rows in ascending key order (stable: rows of one key keep their order,
    so "later rows win" survives), or unchanged when already sorted or the key type does not
    sort. Sorted keys compress better (neighbouring keys share their high bytes) and let
    :func:`storage.chains.resolve_chain` find changed keys by binary search."""
    if table.num_rows < 2 or KEY_COLUMN not in table.schema.names:
        return table
    keys = table.column(KEY_COLUMN)
    try:
        if keys.null_count or _keys_sorted(keys):
            return table
        if pa.types.is_integer(keys.type):
            k = keys.to_numpy()
            order = np.argsort(k)  # unstable, ~4x faster than a stable sort: right when keys are unique
            ordered = k[order]
            if not np.all(ordered[1:] > ordered[:-1]):
                order = np.argsort(k, kind="stable")  # repeated keys: their rows keep their order
            return table.take(pa.array(order))
        order = pc.sort_indices(table, sort_keys=[(KEY_COLUMN, "ascending")])
    except (pa.ArrowNotImplementedError, pa.ArrowTypeError, pa.ArrowInvalid):
        return table  # e.g. struct or list keys: stored in the writer's order
    return table.take(order)


def is_pickled(schema: pa.Schema, column: str) -> bool:
    """True when ``column`` holds pickled Python objects according to the schema metadata."""
    meta = schema.metadata or {}
    if column == KEY_COLUMN:
        return meta.get(META_KEY_ENCODING) == ENCODING_PICKLE
    return column != OP_COLUMN and meta.get(META_VALUE_ENCODING) == ENCODING_PICKLE


def value_columns(schema: pa.Schema) -> list[str]:
    """Every column except ``key`` and ``op``."""
    return [name for name in schema.names if name not in (KEY_COLUMN, OP_COLUMN)]


def normalize_delta(table: pa.Table, *, what: str) -> pa.Table:
    """Validate a delta and return it with an int8 ``op`` column as its last column.

    A table without ``op`` is all upserts. Raises :class:`DeltaSchemaError`.
    """
    if not isinstance(table, pa.Table):
        raise DeltaSchemaError(f"{what}: expected a pyarrow.Table, got {type(table).__name__}; pass a table")
    names = table.schema.names
    if names.count(KEY_COLUMN) != 1:
        raise DeltaSchemaError(f"{what}: the table needs exactly one 'key' column (columns: {names}); add it")
    if names.count(OP_COLUMN) > 1 or len(set(names)) != len(names):
        raise DeltaSchemaError(f"{what}: duplicate column names {names}; rename them")
    if table.column(KEY_COLUMN).null_count:
        raise DeltaSchemaError(f"{what}: the key column has {table.column(KEY_COLUMN).null_count} null keys; keys must not be null")
    if OP_COLUMN in names:
        op = table.column(OP_COLUMN)
        if not pa.types.is_integer(op.type):
            raise DeltaSchemaError(f"{what}: column 'op' has type {op.type}, expected int8 (0 upsert, 1 delete)")
        codes = op.to_numpy() if not op.null_count else None
        if codes is None or ((codes != OP_UPSERT) & (codes != OP_DELETE)).any():
            raise DeltaSchemaError(f"{what}: column 'op' has values other than 0 (upsert) and 1 (delete); fix the encoder")
        if names[-1] == OP_COLUMN and op.type == pa.int8() and not table.schema.field(OP_COLUMN).nullable:
            return table  # already as normalized (a capture's delta table): spare the copy
        op = op.cast(pa.int8())
        table = table.drop_columns([OP_COLUMN])
    else:
        op = pa.array(np.full(table.num_rows, OP_UPSERT, dtype=np.int8))
    return table.append_column(pa.field(OP_COLUMN, pa.int8(), nullable=False), op)


def has_deletes(op: pa.ChunkedArray | pa.Array) -> bool:
    """Whether a (null-free, integer) op column has a row other than an upsert. numpy: a
    tenth of the cost of a compute call on the few thousand rows of a key group's delta."""
    return bool((op.to_numpy() != OP_UPSERT).any())


def delta_for_file(delta: pa.Table) -> pa.Table:
    """The table a delta file stores: ``op`` is dropped when every row is an upsert."""
    if OP_COLUMN in delta.schema.names and not has_deletes(delta.column(OP_COLUMN)):
        return delta.drop_columns([OP_COLUMN])
    return delta
