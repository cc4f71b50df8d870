"""State file encoding: Arrow IPC streams with zstd-compressed buffers, per-file checksums.

Schema conventions (see ``storage/FORMAT.md``):

- column ``key``: typed Arrow keys, or binary pickled keys when the schema metadata says
  ``abs.key_encoding = pickle`` (absent means ``arrow``);
- every other column except ``op`` is a value column (``abs.value_encoding`` likewise);
- deltas carry ``op`` (int8: 0 upsert, 1 delete) unless every row is an upsert (an all-zero
  column carries no information and costs ~200 bytes per small file); bases carry no ``op``;
- the writer's schema metadata is kept as given.

Format 4 adds *values images* (:func:`values_image`): a delta without ``key`` that gives new
values for the rows of its chain's base, positionally.

Format 2 (and later) stores every file as an Arrow IPC *stream* (no footer repeating the
schema), rows of base and delta files sorted by key where the key type sorts, and checksums
with the algorithm named in the manifest (:data:`WRITE_CHECKSUM_ALGORITHM`). Format 1 files
(IPC *files*, ``ARROW1`` magic, ``abs.file_kind`` metadata, SHA-256) are still read.
"""
from __future__ import annotations

import hashlib
import math
import re
import struct
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from abscore.schema import (
    ENCODING_PICKLE,
    KEY_COLUMN,
    META_FILE_KIND,
    META_KEY_ENCODING,
    META_KEYS_DIGEST,
    META_VALUE_ENCODING,
    OP_COLUMN,
    OP_DELETE,
    OP_UPSERT,
)

from .errors import CorruptFileError, DeltaSchemaError, StorageConfigError

__all__ = [
    "KEY_COLUMN",
    "OP_COLUMN",
    "OP_UPSERT",
    "OP_DELETE",
    "META_KEY_ENCODING",
    "META_VALUE_ENCODING",
    "META_FILE_KIND",
    "META_KEYS_DIGEST",
    "CHECKSUM_ALGORITHMS",
    "WRITE_CHECKSUM_ALGORITHM",
    "EncodedFile",
    "compression_level",
    "encode_table",
    "decode_table",
    "iter_batches",
    "DecodeLimits",
    "DEFAULT_DECODE_LIMITS",
    "decoded_size",
    "checksum_hex",
    "is_checksum",
    "sha256_hex",
    "sort_by_key",
    "normalize_delta",
    "delta_for_file",
    "value_columns",
    "is_pickled",
    "is_values_image",
    "keys_digest",
    "strictly_increasing",
    "values_image",
]

# KEY_COLUMN, OP_COLUMN, OP_UPSERT, OP_DELETE and the META_* names of the schema are defined in
# abscore.schema (see there) and handed on from here.

_FILE_MAGIC = b"ARROW1"  # format 1: IPC file; format 2 files start with an IPC stream message
_MAX_BATCH_ROWS = 1 << 17
# zstd level by in-memory table size. Small tables (typical incremental deltas) compress
# poorly for lack of context, and a higher level finds more of what little there is: level 12
# makes ~80-row deltas ~3.5 % smaller than level 6 for ~1 ms more per file (see
# scripts/bench_storage.py --anatomy). Larger tables use zstd's fast level 1: level 12 costs
# ~4 ms per 60 KB, which made writing half-changed key groups of a 1M-key state 6x slower.
# Every level decodes the same way and at the same speed.
_SMALL_TABLE_BYTES = 16 * 1024
_SMALL_TABLE_LEVEL = 12
_LARGE_TABLE_LEVEL = 1
# One thread: a state file has two or three buffers, and handing them to Arrow's thread pool
# cost more than compressing them in place (64 key-group images of 7.8k int64 rows: 23-26 ms
# of CPU with the pool, 16-20 ms without, and less wall time too).
_WRITE_OPTIONS = {
    level: pa.ipc.IpcWriteOptions(compression=pa.Codec("zstd", compression_level=level), use_threads=False)
    for level in (_SMALL_TABLE_LEVEL, _LARGE_TABLE_LEVEL)
}
_READ_OPTIONS = pa.ipc.IpcReadOptions(use_threads=False)  # decoding one small file: threads only cost


# ---------------------------------------------------------------------------- checksums
def _xxh3_128() -> Callable[[bytes | memoryview], str] | None:
    try:
        import xxhash
    except ImportError:
        return None
    return xxhash.xxh3_128_hexdigest


_XXH3_128 = _xxh3_128()

CHECKSUM_ALGORITHMS: dict[str, int] = {"sha256": 64, "blake2b_256": 64, "xxh3_128": 32}
"""Checksum algorithms a manifest may name, with the length of their lower-case hex digest."""

WRITE_CHECKSUM_ALGORITHM = "xxh3_128" if _XXH3_128 is not None else "blake2b_256"
"""What new files are checksummed with: XXH3-128 (~30x faster than SHA-256) when the
``xxhash`` package is installed, else BLAKE2b-256 from the standard library (~2-3x faster)."""


def checksum_hex(data: bytes | memoryview, algorithm: str) -> str:
    """Lower-case hex digest of ``data`` with ``algorithm`` (a key of :data:`CHECKSUM_ALGORITHMS`)."""
    if algorithm == "xxh3_128":
        if _XXH3_128 is None:
            raise StorageConfigError(
                "this file's checksum is XXH3-128, and the 'xxhash' package is not installed; "
                "pip install xxhash to verify it"
            )
        return _XXH3_128(data)
    if algorithm == "blake2b_256":
        return hashlib.blake2b(data, digest_size=32).hexdigest()
    if algorithm == "sha256":
        return hashlib.sha256(data).hexdigest()
    raise StorageConfigError(f"unknown checksum algorithm {algorithm!r}; known: {sorted(CHECKSUM_ALGORITHMS)}")


def is_checksum(value: object, algorithm: object) -> bool:
    """True when ``value`` is a well-formed hex digest of the named algorithm."""
    length = CHECKSUM_ALGORITHMS.get(algorithm) if isinstance(algorithm, str) else None
    return (length is not None and isinstance(value, str) and len(value) == length
            and _LOWER_HEX.fullmatch(value) is not None)


_LOWER_HEX = re.compile(r"[0-9a-f]*")


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------- encoding
@dataclass(frozen=True)
class EncodedFile:
    """The bytes of a file about to be written, with what the manifest records about it."""

    data: bytes
    rows: int
    checksum: str
    checksum_algorithm: str = "sha256"

    @property
    def size(self) -> int:
        return len(self.data)


def _keys_sorted(keys: pa.ChunkedArray) -> bool:
    """True when ``keys`` is in non-decreasing order (False when unsure)."""
    if pa.types.is_integer(keys.type):
        k = keys.to_numpy()
        return bool(np.all(k[1:] >= k[:-1]))
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


def compression_level(table: pa.Table) -> int:
    """The zstd level :func:`encode_table` compresses ``table``'s buffers with."""
    return _SMALL_TABLE_LEVEL if table.nbytes < _SMALL_TABLE_BYTES else _LARGE_TABLE_LEVEL


def encode_table(table: pa.Table, kind: str) -> EncodedFile:
    """Encode ``table`` as an Arrow IPC stream with zstd buffers. Rows of ``base`` and
    ``delta`` tables are sorted by key (see :func:`sort_by_key`); the schema metadata is kept."""
    if kind in ("base", "delta"):
        table = sort_by_key(table)
    if any(col.num_chunks > 1 for col in table.columns):
        table = table.combine_chunks()
    level = compression_level(table)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=_WRITE_OPTIONS[level]) as writer:
        writer.write_table(table, max_chunksize=_MAX_BATCH_ROWS)
    data = sink.getvalue().to_pybytes()
    algorithm = WRITE_CHECKSUM_ALGORITHM
    return EncodedFile(data=data, rows=table.num_rows, checksum=checksum_hex(data, algorithm),
                       checksum_algorithm=algorithm)


def _unreadable(source: str, exc: Exception) -> CorruptFileError:
    return CorruptFileError(f"{source}: not a readable Arrow IPC stream or file ({exc}); the file is corrupt; "
                            "restore from an earlier checkpoint or a savepoint")


def stream_schema(data: bytes, *, source: str) -> pa.Schema:
    """The schema of an encoded file (:func:`decode_table`'s input), from its schema message alone."""
    try:
        opener = pa.ipc.open_file if data[:len(_FILE_MAGIC)] == _FILE_MAGIC else pa.ipc.open_stream
        return opener(pa.BufferReader(data)).schema
    except pa.ArrowMemoryError:
        raise
    except (pa.ArrowException, OSError) as exc:
        raise _unreadable(source, exc) from exc


@dataclass(frozen=True)
class DecodeLimits:
    """How far one state file may expand when decoded, so that a hostile or corrupt file (a
    compression bomb: a few KiB of zstd that inflate to gigabytes) fails with an error naming
    it instead of exhausting memory.

    A file of ``n`` encoded bytes may decode to ``max(min_bytes, max_ratio * n)`` bytes of
    Arrow buffers, and never more than ``max_bytes`` (``None``: no absolute limit). The
    defaults (1000 times, at least 256 MiB, at most 16 GiB) leave room for any state file the
    toolkit writes short of an almost constant column of hundreds of MiB in one key group;
    raise them with ``SnapshotStore.open(..., decode_limits=DecodeLimits.fixed(n))`` or
    ``abs-snapshot --max-decoded-bytes N``. The decoded size is read from the IPC message
    headers (each compressed buffer states its uncompressed length) before anything is
    decompressed.
    """

    max_ratio: float = 1000.0
    min_bytes: int = 256 << 20
    max_bytes: int | None = 16 << 30

    def __post_init__(self) -> None:
        if not (isinstance(self.max_ratio, (int, float)) and self.max_ratio >= 0):
            raise StorageConfigError(f"DecodeLimits.max_ratio={self.max_ratio!r}: use a number >= 0")
        if type(self.min_bytes) is not int or self.min_bytes < 0:
            raise StorageConfigError(f"DecodeLimits.min_bytes={self.min_bytes!r}: use an integer >= 0")
        if self.max_bytes is not None and (type(self.max_bytes) is not int or self.max_bytes < 0):
            raise StorageConfigError(f"DecodeLimits.max_bytes={self.max_bytes!r}: use an integer >= 0 or None")

    @classmethod
    def fixed(cls, limit: int) -> "DecodeLimits":
        """Every file may decode to ``limit`` bytes, whatever its encoded size."""
        return cls(max_ratio=0.0, min_bytes=limit, max_bytes=limit)

    def allowed(self, encoded_bytes: int) -> int:
        """How many decoded bytes a file of ``encoded_bytes`` may have."""
        ratio = self.max_ratio * encoded_bytes
        allowed = max(self.min_bytes, int(ratio) if math.isfinite(ratio) else 1 << 62)
        return allowed if self.max_bytes is None else min(allowed, self.max_bytes)

    def describe(self) -> str:
        if self.max_ratio == 0 and self.min_bytes == self.max_bytes:
            return f"the decode limit of {self.min_bytes} bytes"
        most = "" if self.max_bytes is None else f", at most {self.max_bytes} bytes"
        return f"the decode limit ({self.max_ratio:g} times the encoded size, at least {self.min_bytes} bytes{most})"


DEFAULT_DECODE_LIMITS = DecodeLimits()


# IPC message headers are flatbuffers (Arrow's format/Message.fbs). Reading the few fields
# needed to add up a record batch's buffer sizes takes a dozen struct reads; pyarrow decodes
# (and decompresses) a batch only as a whole.
_U16, _U32, _I32, _I64 = struct.Struct("<H"), struct.Struct("<I"), struct.Struct("<i"), struct.Struct("<q")
_BUFFER = struct.Struct("<qq")
_HEADER_DICTIONARY_BATCH, _HEADER_RECORD_BATCH = 2, 3


def _fb_field(buf: bytes, table: int, slot: int) -> int | None:
    """Position of field ``slot`` of the flatbuffer table at ``table``, or ``None`` if absent."""
    vtable = table - _I32.unpack_from(buf, table)[0]
    if 4 + 2 * slot + 2 > _U16.unpack_from(buf, vtable)[0]:
        return None
    at = _U16.unpack_from(buf, vtable + 4 + 2 * slot)[0]
    return table + at if at else None


def _fb_ref(buf: bytes, pos: int) -> int:
    return pos + _U32.unpack_from(buf, pos)[0]


def _batch_decoded_size(buf: bytes, batch: int, body: int, body_size: int) -> int:
    """Bytes the buffers of the RecordBatch table at ``batch`` take once decompressed, and at
    least one per row (a column of the null type has rows but no buffers, and a reader still
    walks them); its message body is ``buf[body:body + body_size]``."""
    rows_at = _fb_field(buf, batch, 0)  # length: long
    rows = _I64.unpack_from(buf, rows_at)[0] if rows_at is not None else 0
    if rows < 0:
        raise ValueError(f"a record batch states {rows} rows")
    return max(rows, _buffers_size(buf, batch, body, body_size))


def _buffers_size(buf: bytes, batch: int, body: int, body_size: int) -> int:
    at = _fb_field(buf, batch, 2)  # buffers: [Buffer{offset: long, length: long}]
    if at is None:
        return 0
    vector = _fb_ref(buf, at)
    count = _U32.unpack_from(buf, vector)[0]
    compressed = _fb_field(buf, batch, 3) is not None  # BodyCompression: every buffer has a length prefix
    total = 0
    for i in range(count):
        offset, length = _BUFFER.unpack_from(buf, vector + 4 + 16 * i)
        if length <= 0:
            continue
        if offset < 0 or offset + length > body_size:
            raise ValueError(f"buffer {i} [{offset}, {offset + length}) lies outside the message body of {body_size} bytes")
        if not compressed:
            total += length
            continue
        if length < 8:
            raise ValueError(f"compressed buffer {i} has {length} bytes, fewer than its 8-byte length prefix")
        size = _I64.unpack_from(buf, body + offset)[0]
        if size < -1:
            raise ValueError(f"compressed buffer {i} states a negative uncompressed length {size}")
        total += length - 8 if size == -1 else size
    return total


def decoded_size(data: bytes, *, source: str) -> int:
    """Bytes of Arrow buffers ``data`` (an encoded state file) decodes to, read from its
    message headers without decompressing anything (a few microseconds)."""
    try:
        return _decoded_size(data)
    except (ValueError, struct.error, IndexError) as exc:
        raise _unreadable(source, exc) from exc


def _decoded_size(data: bytes) -> int:
    end = len(data)
    pos = 8 if data[:len(_FILE_MAGIC)] == _FILE_MAGIC else 0  # an IPC file holds a stream after its magic
    total = 0
    while pos + 4 <= end:
        size = _I32.unpack_from(data, pos)[0]
        pos += 4
        if size == -1:  # continuation marker, then the metadata length
            if pos + 4 > end:
                break
            size = _I32.unpack_from(data, pos)[0]
            pos += 4
        if size == 0:  # end of stream
            break
        if size < 0 or pos + size > end:
            raise ValueError(f"a message header of {size} bytes at byte {pos} does not fit in the file")
        root = _fb_ref(data, pos)
        at = _fb_field(data, root, 3)  # Message.bodyLength
        body_size = _I64.unpack_from(data, at)[0] if at is not None else 0
        body = pos + size
        if body_size < 0 or body + body_size > end:
            raise ValueError(f"a message body of {body_size} bytes at byte {body} does not fit in the file")
        type_at, header_at = _fb_field(data, root, 1), _fb_field(data, root, 2)
        if type_at is not None and header_at is not None:
            kind, header = data[type_at], _fb_ref(data, header_at)
            if kind == _HEADER_DICTIONARY_BATCH:
                batch_at = _fb_field(data, header, 1)
                if batch_at is not None:
                    total += _batch_decoded_size(data, _fb_ref(data, batch_at), body, body_size)
            elif kind == _HEADER_RECORD_BATCH:
                total += _batch_decoded_size(data, header, body, body_size)
        pos = body + body_size
    return total


def _check_decoded_size(data: bytes, source: str, limits: DecodeLimits | None) -> None:
    limits = DEFAULT_DECODE_LIMITS if limits is None else limits
    allowed = limits.allowed(len(data))
    size = decoded_size(data, source=source)
    if size > allowed:
        raise CorruptFileError(
            f"{source}: {len(data)} encoded bytes would decode to {size} bytes, beyond {limits.describe()}; "
            "refusing to decode it (a corrupt or hostile file, e.g. a compression bomb); if you trust this root, "
            "raise the limit (abs-snapshot --max-decoded-bytes N, or SnapshotStore.open(..., "
            "decode_limits=DecodeLimits.fixed(N)))"
        )


def _read_options(data: bytes, source: str, columns: list[str] | None) -> pa.ipc.IpcReadOptions:
    if columns is None:
        return _READ_OPTIONS
    names = stream_schema(data, source=source).names
    return pa.ipc.IpcReadOptions(use_threads=False, included_fields=[i for i, n in enumerate(names) if n in columns])


def decode_table(data: bytes, *, source: str, columns: list[str] | None = None,
                 limits: DecodeLimits | None = None) -> pa.Table:
    """Decode an Arrow IPC stream (format 2) or file (format 1, ``ARROW1`` magic); ``source``
    names the file in the error if it does not decode. ``columns``: decode only these (the
    others are not even decompressed; names the file lacks are ignored). ``limits``: how far
    the file may expand (default :data:`DEFAULT_DECODE_LIMITS`), checked before decompressing."""
    _check_decoded_size(data, source, limits)
    try:
        opener = pa.ipc.open_file if data[:len(_FILE_MAGIC)] == _FILE_MAGIC else pa.ipc.open_stream
        return opener(pa.BufferReader(data), options=_read_options(data, source, columns)).read_all()
    except pa.ArrowMemoryError:
        raise
    except (pa.ArrowException, OSError) as exc:
        raise _unreadable(source, exc) from exc


def iter_batches(data: bytes, *, source: str, limits: DecodeLimits | None = None) -> Iterator[pa.RecordBatch]:
    """The record batches of an encoded file, decoded one at a time (a reader that stops
    early decompresses no more); the file's decoded size is checked against ``limits`` first."""
    _check_decoded_size(data, source, limits)
    try:
        opener = pa.ipc.open_file if data[:len(_FILE_MAGIC)] == _FILE_MAGIC else pa.ipc.open_stream
        reader = opener(pa.BufferReader(data), options=_READ_OPTIONS)
        if isinstance(reader, pa.ipc.RecordBatchFileReader):
            batches: Iterator[pa.RecordBatch] = (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            batches = iter(reader)
        yield from batches
    except pa.ArrowMemoryError:
        raise
    except (pa.ArrowException, OSError) as exc:
        raise _unreadable(source, exc) from exc


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


# ---------------------------------------------------------------------------- values images
def keys_digest(keys: pa.ChunkedArray | pa.Array, algorithm: str = WRITE_CHECKSUM_ALGORITHM) -> str | None:
    """``<algorithm>:<hex digest>`` of an int64 key column without nulls (its values as
    little-endian 8-byte integers), or ``None`` for any other column."""
    if not pa.types.is_int64(keys.type) or keys.null_count:
        return None
    data = np.ascontiguousarray(keys.to_numpy(), dtype="<i8")
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
        if not strictly_increasing(keys.to_numpy()):
            return None  # repeated keys: rows cannot stand for the base's rows one to one
    digest = keys_digest(keys)
    if digest is None:
        return None
    meta = dict(image.schema.metadata or {})
    meta[META_KEYS_DIGEST] = digest.encode()
    return image.drop_columns([KEY_COLUMN]).replace_schema_metadata(meta)
