"""The Arrow encoding of keyed state: delta tables and their decoding.

Table encoding: the key column is ``int64``, ``string`` or ``binary`` when every key of the
table is an ``int`` (in int64 range), a ``str`` or a ``bytes``; otherwise a ``binary`` column of
pickled keys.  The value column has the state's Arrow type (see ``value_arrow_type()``), or is
a ``binary`` column of pickled values (pickle protocol 5).  Deleted keys have a null value.
Column ``op`` (int8, not null): 0 upsert, 1 delete.  Schema metadata: ``abs.key_encoding``
(``arrow``|``pickle``), ``abs.value_encoding`` (``arrow``|``pickle``), ``abs.state_kind``.
The column names, op codes and metadata names are those of the file schema, defined once in
:mod:`abscore.schema`.

Both backends (:mod:`abs.state.dict_backend`, :mod:`abs.state.columnar`) write tables of this
shape, so storage, restore and inspection cannot tell them apart.
"""
from __future__ import annotations

import itertools
import operator
import pickle
from typing import Any, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from abs.columns import _text_array
from abs.errors import StateError
from abscore.schema import (
    ENCODING_ARROW,
    ENCODING_PICKLE,
    META_KEY_ENCODING,
    META_STATE_KIND,
    META_VALUE_ENCODING,
    OP_DELETE,
    OP_UPSERT,
)

from .varkeys import VarKeys

__all__ = [
    "OP_UPSERT",
    "OP_DELETE",
    "META_KEY_ENCODING",
    "META_VALUE_ENCODING",
    "META_STATE_KIND",
    "ENCODING_ARROW",
    "ENCODING_PICKLE",
    "MISSING",
    "check_restore_table",
    "column_table",
    "arrow_to_list",
    "decode_column",
    "delta_table",
    "encode",
    "encode_keys",
    "encode_pairs",
    "pickled_values",
    "split_deletes",
    "values_metadata",
    "values_table",
]

PICKLE_PROTOCOL = 5
MISSING: Any = object()
"""Stands for "no value" (a deleted or absent key) in value lists, where None is a value."""


# ----------------------------------------------------------------------------- delta tables


def encode(uid: str, slot: Any, kg: int, keys: Iterable[Any], d: dict, *, with_op: bool) -> pa.Table:
    """The delta table of ``keys`` of one key group's dict ``d`` (absent keys: deletes).
    ``slot``: the state's slot (its ``descriptor`` and ``arrow_type``)."""
    keys = list(keys)
    get = d.get
    return encode_pairs(uid, slot, kg, keys, list(map(get, keys, itertools.repeat(MISSING))), with_op=with_op)


def encode_pairs(uid: str, slot: Any, kg: int, keys: list, values: list, *, with_op: bool,
                 deletes: bool | None = None) -> pa.Table:
    """Encode keys and their values (``MISSING``: deleted) as a delta table.
    ``deletes=False``: the caller knows no value is ``MISSING``."""
    if deletes is False:
        ops: Any = np.zeros(len(values), dtype=np.int8)  # all upserts (zero-copy into Arrow)
    else:
        values, ops = split_deletes(values)
    key_arr, key_enc = encode_keys(keys)
    value_arr, value_enc = _encode_values(uid, slot, kg, keys, values, ops)
    return delta_table(slot.descriptor.kind, key_arr, key_enc, value_arr, value_enc, ops, with_op=with_op)


def _encode_values(uid: str, slot: Any, kg: int, keys: list, values: list, ops: Any) -> tuple[pa.Array, bytes]:
    t = slot.arrow_type
    if t is None:
        return pickled_values(values, ops), ENCODING_PICKLE
    if slot.descriptor.kind == "map":
        values = [None if v is None else list(v.items()) for v in values]
    try:
        return pa.array(values, t), ENCODING_ARROW
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError, ValueError) as exc:
        bad_key, bad_value = _first_unconvertible(keys, values, t)
        raise StateError(
            f"operator {uid!r}, state {slot.descriptor.name!r}, key group "
            f"{kg}: value {bad_value!r} of key {bad_key!r} does not fit the declared Arrow "
            f"type {t} ({exc}); write values of that type or declare the state without a "
            "type (pickled)"
        ) from exc


def split_deletes(values: list) -> tuple[list, Any]:
    """``values`` with each ``MISSING`` (a deleted key) as ``None``, and the op column: a list
    when there are deletes, else int8 zeros (zero-copy into Arrow)."""
    missing = MISSING
    # identity only (a value's own __eq__ may be anything): a C-level scan
    if not any(map(operator.is_, values, itertools.repeat(missing))):
        return values, np.zeros(len(values), dtype=np.int8)
    ops = [OP_DELETE if v is missing else OP_UPSERT for v in values]
    return [None if v is missing else v for v in values], ops


def pickled_values(values: list, ops: Any) -> pa.Array:
    """The binary value column of an untyped state: each value pickled on its own, null for
    a delete."""
    dumps = pickle.dumps
    if isinstance(ops, np.ndarray):  # all upserts
        blobs = [dumps(v, PICKLE_PROTOCOL) for v in values]
    else:
        blobs = [None if o else dumps(v, PICKLE_PROTOCOL) for v, o in zip(values, ops)]
    return pa.array(blobs, pa.binary())


def column_table(t: pa.DataType | None, kind: str, keys: np.ndarray | VarKeys | pa.Array | list, values: np.ndarray | list,
                  nulls: np.ndarray | None, deleted: list, *, with_op: bool = True) -> pa.Table:
    """A delta table from captured columns: upserts of ``keys``, then deletes of ``deleted``.
    ``t`` None: an untyped column, its values pickled one by one (the rows a dict key group
    of the same state would give). ``with_op=False`` (no ``deleted``): without the ``op``
    column, as a base stores its rows."""
    if t is None:
        value_arr, value_enc = pickled_values(values, np.zeros(len(values), dtype=np.int8)), ENCODING_PICKLE
    else:
        value_arr, value_enc = pa.array(values, t, mask=nulls), ENCODING_ARROW
    ops = np.zeros(len(values) + len(deleted), dtype=np.int8)
    if deleted:
        key_arr, key_enc = encode_keys((keys.to_pylist() if isinstance(keys, pa.Array) else keys.tolist()
                                          if isinstance(keys, (np.ndarray, VarKeys)) else list(keys)) + deleted)
        value_arr = pa.concat_arrays([value_arr, pa.nulls(len(deleted), value_arr.type)])
        ops[len(values):] = OP_DELETE
    elif isinstance(keys, np.ndarray):
        key_arr, key_enc = pa.array(keys, pa.int64()), ENCODING_ARROW
    elif isinstance(keys, VarKeys):
        key_arr, key_enc = keys.to_arrow(), ENCODING_ARROW
    elif isinstance(keys, pa.Array):  # str or bytes keys the writer sorted (abs.columns.KeyOrders.sort_text)
        key_arr, key_enc = keys, ENCODING_ARROW
    else:
        key_arr, key_enc = encode_keys(list(keys))
    return delta_table(kind, key_arr, key_enc, value_arr, value_enc, ops, with_op=with_op or bool(deleted))


def check_restore_table(table: pa.Table, declared_kind: str, where: str) -> None:
    """Refuse a table that cannot be restored into a state of ``declared_kind``: another
    state kind in its metadata, no ``key``/``value`` columns, or unresolved deletes."""
    meta = table.schema.metadata or {}
    kind = meta.get(META_STATE_KIND)
    if kind is not None and kind.decode() != declared_kind:
        raise StateError(
            f"{where}: the table holds {kind.decode()} state but the state is declared as "
            f"{declared_kind} state; restore into a state of the same kind (or migrate "
            "the snapshot offline)"
        )
    names = table.schema.names
    if "key" not in names or "value" not in names:
        raise StateError(f"{where}: table has columns {names}, needs 'key' and 'value'; "
                         "pass a table produced by capture (resolved)")
    if "op" in names and table.num_rows and pc.any(pc.not_equal(table.column("op"), OP_UPSERT)).as_py():
        raise StateError(
            f"{where}: the table contains deletes; resolve the chain (apply deltas in order) "
            "before restoring"
        )


_SCHEMAS: dict[tuple, pa.Schema] = {}  # delta_table's schemas: made once (~5 us each; a key group's write)


def delta_table(kind: str, key_arr: pa.Array, key_enc: bytes, value_arr: pa.Array, value_enc: bytes,
                 ops: Any, *, with_op: bool) -> pa.Table:
    arrays = [key_arr, value_arr]
    if with_op:
        arrays.append(pa.array(ops, pa.int8()))
    shape = (kind, key_arr.type, key_enc, value_arr.type, value_enc, with_op)
    schema = _SCHEMAS.get(shape)
    if schema is None:
        fields = [pa.field("key", key_arr.type), pa.field("value", value_arr.type)]
        if with_op:
            fields.append(pa.field("op", pa.int8(), nullable=False))
        if len(_SCHEMAS) > 256:
            _SCHEMAS.clear()
        schema = _SCHEMAS[shape] = pa.schema(fields, metadata=_delta_metadata(kind, key_enc, value_enc))
    return pa.Table.from_arrays(arrays, schema=schema)


def values_table(t: pa.DataType, kind: str, values: np.ndarray, nulls: np.ndarray | None) -> pa.Table:
    """The ``value`` column of a typed state's rows, with the schema metadata of the
    :func:`column_table` of int64 keys: what a delta table of those rows holds besides its
    ``key`` and ``op`` columns (a values image's input, :mod:`storage.values_images`)."""
    return pa.Table.from_arrays([pa.array(values, t, mask=nulls)],
                                schema=pa.schema([pa.field("value", t)], metadata=values_metadata(kind)))


def values_metadata(kind: str) -> dict:
    """The schema metadata of :func:`values_table` (typed keys and values of a state of ``kind``)."""
    return _delta_metadata(kind, ENCODING_ARROW, ENCODING_ARROW)


def _delta_metadata(kind: str, key_enc: bytes, value_enc: bytes) -> dict:
    return {META_KEY_ENCODING: key_enc, META_VALUE_ENCODING: value_enc, META_STATE_KIND: kind.encode()}


def encode_keys(keys: list) -> tuple[pa.Array, bytes]:
    types = set(map(type, keys))
    if len(types) == 1:
        (only,) = types
        if only is str or only is bytes:
            arr = _text_array(keys)  # abs.columns: the C copy where built; None for lone surrogates
            if arr is not None:
                return arr, ENCODING_ARROW
        elif only is int:
            try:
                return pa.array(keys, pa.int64()), ENCODING_ARROW
            except (OverflowError, pa.ArrowInvalid, pa.ArrowTypeError):
                pass  # ints beyond int64: pickle below
    dumps = pickle.dumps
    return pa.array([dumps(k, PICKLE_PROTOCOL) for k in keys], pa.binary()), ENCODING_PICKLE


def decode_column(column: pa.ChunkedArray, encoding: bytes | None, where: str, what: str) -> list:
    if encoding == ENCODING_ARROW:
        return arrow_to_list(column)
    if encoding == ENCODING_PICKLE:
        loads = pickle.loads
        return [None if b is None else loads(b) for b in column.to_pylist()]
    raise StateError(
        f"{where}: {what} column has encoding {encoding!r} in the schema metadata "
        f"({META_KEY_ENCODING.decode()}/{META_VALUE_ENCODING.decode()} must be 'arrow' or "
        "'pickle'); the file was not written by this version of abs or is corrupt"
    )


def arrow_to_list(column: pa.ChunkedArray | pa.Array) -> list:
    """``column.to_pylist()``, faster where it can be: integers, float64 and booleans without
    nulls go through numpy (the same Python ints, floats and bools; 1M int64 keys 48 ms
    instead of 91 ms), strings and binaries through an object array of the same str/bytes
    objects (None for nulls; 1M ~100-byte strings 0.28 s instead of 0.32 s)."""
    t = column.type
    if column.null_count == 0 and (pa.types.is_integer(t) or pa.types.is_boolean(t)
                                   or pa.types.is_float64(t)):
        return column.to_numpy(zero_copy_only=False).tolist()
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return column.to_numpy(zero_copy_only=False).tolist()
    return column.to_pylist()


def _first_unconvertible(keys: list, values: list, t: pa.DataType) -> tuple[Any, Any]:
    for k, v in zip(keys, values):
        try:
            pa.array([v], t)
        except Exception:  # noqa: BLE001 - only locating the culprit for the message
            return k, v
    return None, None
