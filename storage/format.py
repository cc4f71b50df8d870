"""State file encoding: Arrow IPC *file* format with zstd-compressed buffers, SHA-256 checksums.

Schema conventions (see ``storage/FORMAT.md``):

- column ``key``: typed Arrow keys, or binary pickled keys when the schema metadata says
  ``abs.key_encoding = pickle`` (absent means ``arrow``);
- every other column except ``op`` is a value column (``abs.value_encoding`` likewise);
- deltas carry ``op`` (int8: 0 upsert, 1 delete) unless every row is an upsert (an all-zero
  column carries no information and costs ~200 bytes per small file); bases carry no ``op``;
- the writer's schema metadata is kept; the store adds ``abs.file_kind``.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .errors import CorruptFileError, DeltaSchemaError

__all__ = [
    "KEY_COLUMN",
    "OP_COLUMN",
    "OP_UPSERT",
    "OP_DELETE",
    "META_KEY_ENCODING",
    "META_VALUE_ENCODING",
    "META_FILE_KIND",
    "EncodedFile",
    "encode_table",
    "decode_table",
    "sha256_hex",
    "normalize_delta",
    "delta_for_file",
    "value_columns",
    "is_pickled",
]

KEY_COLUMN = "key"
OP_COLUMN = "op"
OP_UPSERT = 0
OP_DELETE = 1
META_KEY_ENCODING = b"abs.key_encoding"
META_VALUE_ENCODING = b"abs.value_encoding"
META_FILE_KIND = b"abs.file_kind"

_MAX_BATCH_ROWS = 1 << 17
# zstd level by in-memory table size. Small tables (typical incremental deltas) compress
# poorly for lack of context; level 6 makes them ~7 % smaller than level 1 for about 0.5 ms
# per file (measured with scripts/bench_storage.py: 1 % deltas of 1M keys in 128 key groups).
# Large tables (bases) use zstd's fast level 1. Every level decodes the same way.
_SMALL_TABLE_BYTES = 64 * 1024
_SMALL_TABLE_LEVEL = 6
_LARGE_TABLE_LEVEL = 1
_WRITE_OPTIONS = {
    level: pa.ipc.IpcWriteOptions(compression=pa.Codec("zstd", compression_level=level))
    for level in (_SMALL_TABLE_LEVEL, _LARGE_TABLE_LEVEL)
}


@dataclass(frozen=True)
class EncodedFile:
    """The bytes of a file about to be written, with what the manifest records about it."""

    data: bytes
    rows: int
    checksum: str

    @property
    def size(self) -> int:
        return len(self.data)


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def encode_table(table: pa.Table, kind: str) -> EncodedFile:
    """Encode ``table`` as an Arrow IPC file with zstd buffers; records ``abs.file_kind``."""
    metadata = dict(table.schema.metadata or {})
    metadata[META_FILE_KIND] = kind.encode()
    table = table.replace_schema_metadata(metadata)
    if any(col.num_chunks > 1 for col in table.columns):
        table = table.combine_chunks()
    level = _SMALL_TABLE_LEVEL if table.nbytes < _SMALL_TABLE_BYTES else _LARGE_TABLE_LEVEL
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema, options=_WRITE_OPTIONS[level]) as writer:
        writer.write_table(table, max_chunksize=_MAX_BATCH_ROWS)
    data = sink.getvalue().to_pybytes()
    return EncodedFile(data=data, rows=table.num_rows, checksum=sha256_hex(data))


def decode_table(data: bytes, *, source: str) -> pa.Table:
    """Decode an Arrow IPC file; ``source`` names it in the error if it does not decode."""
    try:
        return pa.ipc.open_file(pa.BufferReader(data)).read_all()
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
        raise CorruptFileError(
            f"{source}: not a readable Arrow IPC file ({exc}); the file is corrupt; "
            "restore from an earlier checkpoint or a savepoint"
        ) from exc


def is_pickled(schema: pa.Schema, column: str) -> bool:
    """True when ``column`` holds pickled Python objects according to the schema metadata."""
    meta = schema.metadata or {}
    if column == KEY_COLUMN:
        return meta.get(META_KEY_ENCODING) == b"pickle"
    return column != OP_COLUMN and meta.get(META_VALUE_ENCODING) == b"pickle"


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
        if op.null_count or table.num_rows and not pc.all(pc.is_in(op, pa.array([OP_UPSERT, OP_DELETE], op.type))).as_py():
            raise DeltaSchemaError(f"{what}: column 'op' has values other than 0 (upsert) and 1 (delete); fix the encoder")
        op = op.cast(pa.int8())
        table = table.drop_columns([OP_COLUMN])
    else:
        op = pa.array(np.full(table.num_rows, OP_UPSERT, dtype=np.int8))
    return table.append_column(pa.field(OP_COLUMN, pa.int8(), nullable=False), op)


def delta_for_file(delta: pa.Table) -> pa.Table:
    """The table a delta file stores: ``op`` is dropped when every row is an upsert."""
    if OP_COLUMN in delta.schema.names and not pc.any(pc.not_equal(delta.column(OP_COLUMN), OP_UPSERT)).as_py():
        return delta.drop_columns([OP_COLUMN])
    return delta
