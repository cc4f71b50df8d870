"""Values images (format 4): a delta without ``key`` that gives new values for the rows of
its chain's base, positionally, with :data:`META_KEYS_DIGEST` naming the base's keys."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from abscore.native import NATIVE
from abscore.schema import KEY_COLUMN, META_KEYS_DIGEST, OP_COLUMN

from .checksums import WRITE_CHECKSUM_ALGORITHM, checksum_hex
from .tables import has_deletes, sort_by_key

__all__ = [
    "keys_digest",
    "strictly_increasing",
    "is_values_image",
    "values_image",
    "values_image_over",
    "int64_digest",
    "META_BYTE_STREAM_SPLIT",
    "split_byte_streams",
    "join_byte_streams",
    "split_image_schema",
    "split_values_image",
]

META_BYTE_STREAM_SPLIT = b"abs.byte_stream_split"
"""Field metadata of a values image's column (format 8) stored byte-stream split: the name of
its Arrow type (``int64``, ``double``, ...). See :func:`split_byte_streams`."""

# fixed-width numeric types a values image splits, by name (pa.DataType's str)
_SPLIT_TYPES = {str(t): t for t in (pa.int16(), pa.int32(), pa.int64(), pa.uint16(), pa.uint32(), pa.uint64(),
                                    pa.float16(), pa.float32(), pa.float64())}


def keys_digest(keys: pa.ChunkedArray | pa.Array, algorithm: str = WRITE_CHECKSUM_ALGORITHM) -> str | None:
    """``<algorithm>:<hex digest>`` of an int64 key column without nulls (its values as
    little-endian 8-byte integers), or ``None`` for any other column."""
    if not pa.types.is_int64(keys.type) or keys.null_count:
        return None
    return int64_digest(keys.to_numpy(), algorithm)


def int64_digest(keys: np.ndarray, algorithm: str = WRITE_CHECKSUM_ALGORITHM) -> str:
    """:func:`keys_digest` of int64 keys held in numpy."""
    data = np.ascontiguousarray(keys, dtype="<i8")
    return f"{algorithm}:{checksum_hex(memoryview(data).cast('B'), algorithm)}"


def strictly_increasing(k: np.ndarray) -> bool:
    """Whether the integer array ``k`` strictly increases. Counting violations, not
    ``np.all()``: no numpy reduction, whose Python-level wrapper costs several times the
    comparison on a key group's few thousand keys."""
    return not np.count_nonzero(k[1:] <= k[:-1])


def is_values_image(table: pa.Table) -> bool:
    """Whether a state file's table is a values image: a delta without a ``key`` column."""
    return KEY_COLUMN not in table.schema.names


def values_image(image: pa.Table) -> pa.Table | None:
    """The table a *values image* stores for ``image``, a key group's full image (``key``,
    value columns, ``op`` absent or all upserts) whose keys are exactly those of the chain's
    base: the value columns alone, rows in ascending key order, so that row ``i`` holds the
    values of the base's row ``i``, and :data:`META_KEYS_DIGEST` naming those keys.

    Why: a state whose keys stay the same while every value changes (counters of a fixed key
    set) would otherwise write the same keys again at every checkpoint; the keys are about
    half of such a file's bytes and of the zstd work. ``None`` when the image does not
    qualify: keys not int64, not unique, or null."""
    if OP_COLUMN in image.schema.names:
        if has_deletes(image.column(OP_COLUMN)):
            return None
        image = image.drop_columns([OP_COLUMN])
    keys = image.column(KEY_COLUMN)
    if not pa.types.is_int64(keys.type) or keys.null_count:
        return None
    if not strictly_increasing(keys.to_numpy()):  # the writer's images come sorted
        image = sort_by_key(image)
        keys = image.column(KEY_COLUMN)
    return values_image_over(keys.to_numpy(), image.drop_columns([KEY_COLUMN]))  # None where keys repeat


def values_image_over(keys: np.ndarray, values: pa.Table, digest: str | None = None) -> pa.Table | None:
    """:func:`values_image` of a full image given as its int64 keys in ascending order and its
    other columns in the same order (no ``key``, no ``op``; the delta's schema metadata): a
    writer that holds the image's columns apart makes it without building the image's table.
    ``digest``: :func:`int64_digest` of ``keys`` when the caller kept it from the last image
    of the same keys. ``None`` when a key repeats."""
    if not strictly_increasing(keys):
        return None  # repeated keys: rows cannot stand for the base's rows one to one
    meta = dict(values.schema.metadata or {})
    meta[META_KEYS_DIGEST] = (int64_digest(keys) if digest is None else digest).encode()
    return split_byte_streams(values.replace_schema_metadata(meta))


def split_byte_streams(table: pa.Table) -> pa.Table:
    """``table`` with each numeric column of 2-, 4- or 8-byte values without nulls stored
    *byte-stream split* (format 8, Parquet's BYTE_STREAM_SPLIT): as a ``fixed_size_binary``
    column of the same width and length whose data buffer holds the first byte of every
    value, then the second byte of every value, and so on, and whose field metadata
    :data:`META_BYTE_STREAM_SPLIT` names the column's type.

    Why: a values image's values are counters and sums: their high bytes are zero or barely
    change. zstd, fed those bytes one run after the other instead of interleaved, compresses
    them ~3x faster to the same size or smaller (64 key groups of 7.8 k running sums: 11.3 ms
    and 952 KB as int64, 4.4 ms and 940 KB split, the split itself (~30 us a key group)
    included). Encoding was ~45 % of a snapshot writer's CPU on the ABS paper's workload; the
    writer's CPU per checkpoint fell 13 % (scripts/bench_writer.py). :func:`join_byte_streams`
    undoes it."""
    columns, fields, changed = [], [], False
    for field, column in zip(table.schema, table.columns):
        if str(field.type) not in _SPLIT_TYPES or column.null_count or not len(column):
            columns.append(column)
            fields.append(field)
            continue
        columns.append(_split_column(np.ascontiguousarray(column.to_numpy())))
        fields.append(_split_field(field))
        changed = True
    if not changed:
        return table
    return pa.Table.from_arrays(columns, schema=pa.schema(fields, metadata=table.schema.metadata))


def _split_field(field: pa.Field) -> pa.Field:
    """The field of ``field``'s column stored byte-stream split (its type named in its metadata)."""
    return pa.field(field.name, pa.binary(field.type.bit_width // 8), nullable=field.nullable,
                    metadata={**(field.metadata or {}), META_BYTE_STREAM_SPLIT: str(field.type).encode()})


def _split_column(values: np.ndarray) -> pa.Array:
    """Contiguous fixed-width values as the ``fixed_size_binary`` column of their byte planes."""
    width = values.dtype.itemsize
    planes = byte_planes(values.view(np.uint8), width, split=True)
    return pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), len(values), [None, pa.py_buffer(planes)])


def split_image_schema(value_type: pa.DataType, metadata: dict, digest: str) -> pa.Schema | None:
    """The schema :func:`values_image_over` gives the values image of a single ``value`` column
    of ``value_type`` without nulls (``metadata``: the delta's schema metadata; ``digest``: its
    keys' :func:`int64_digest`), when that column is stored byte-stream split; None for a type
    that is not split. With :func:`split_values_image`, a writer that keeps this schema from one
    checkpoint to the next (the same while the keys stay) builds a key group's values image from
    its values alone: ~20 us instead of ~50 (the value table, then its split copy)."""
    if str(value_type) not in _SPLIT_TYPES:
        return None
    return pa.schema([_split_field(pa.field("value", value_type))],
                     metadata={**metadata, META_KEYS_DIGEST: digest.encode()})


def split_values_image(values: np.ndarray, schema: pa.Schema) -> pa.Table:
    """The values image :func:`values_image_over` makes of ``values`` (no nulls, in key order,
    of the type ``schema`` names) under a :func:`split_image_schema`: the same table."""
    return pa.Table.from_arrays([_split_column(np.ascontiguousarray(values))], schema=schema)


def join_byte_streams(table: pa.Table) -> pa.Table:
    """``table`` with its byte-stream split columns (:func:`split_byte_streams`) as the
    numeric columns they were; a table without any is returned as is. A split column whose
    metadata names a type this code does not split, or whose width differs from that
    type's, raises ``ValueError`` (the file is corrupt)."""
    if not any(f.metadata and META_BYTE_STREAM_SPLIT in f.metadata for f in table.schema):
        return table
    columns, fields = [], []
    for field, column in zip(table.schema, table.columns):
        name = (field.metadata or {}).get(META_BYTE_STREAM_SPLIT)
        if name is None:
            columns.append(column)
            fields.append(field)
            continue
        type_name = name.decode(errors="replace")
        t = _SPLIT_TYPES.get(type_name)
        if t is None or field.type != pa.binary(t.bit_width // 8) or column.null_count:
            raise ValueError(f"column {field.name!r} is marked byte-stream split as {type_name!r} but is {field.type}"
                             f"{' with nulls' if column.null_count else ''}; only the fixed-width numeric types "
                             f"{sorted(_SPLIT_TYPES)} are split, without nulls")
        width, n = t.bit_width // 8, len(column)
        arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
        planes = np.frombuffer(arr.buffers()[1], np.uint8, n * width, arr.offset * width)
        values = byte_planes(planes, width, split=False).view(t.to_pandas_dtype())
        columns.append(pa.array(values, t))
        meta = {k: v for k, v in (field.metadata or {}).items() if k != META_BYTE_STREAM_SPLIT}
        fields.append(pa.field(field.name, t, nullable=field.nullable, metadata=meta or None))
    return pa.Table.from_arrays(columns, schema=pa.schema(fields, metadata=table.schema.metadata))


def byte_planes(data: np.ndarray, width: int, *, split: bool) -> np.ndarray:
    """The bytes of ``len(data) // width`` values of ``width`` bytes (contiguous uint8) as
    their byte planes, byte ``b`` of value ``i`` at ``b * n + i`` (``split``), or planes back
    to values (not ``split``): a new array. C transposes 16 eight-byte values at a time in
    SSE2 registers (7.8 k int64, a key group of the ABS paper's workload at p=2: 18 -> 2.9 us);
    numpy copies a strided view byte by byte."""
    if NATIVE is not None:
        out = np.empty(len(data), np.uint8)
        NATIVE.byte_streams(data, out, width, split)
        return out
    shape = (-1, width) if split else (width, -1)
    return np.ascontiguousarray(data.reshape(shape).T).reshape(-1)
