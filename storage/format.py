"""State file encoding: Arrow IPC streams with zstd-compressed buffers, per-file checksums.

Format 2 (and later) stores every file as an Arrow IPC *stream* (no footer repeating the
schema), rows of base and delta files sorted by key where the key type sorts, and checksums
with the algorithm named in the manifest (:data:`WRITE_CHECKSUM_ALGORITHM`). Format 1 files
(IPC *files*, ``ARROW1`` magic, ``abs.file_kind`` metadata, SHA-256) are still read. The
writer's schema metadata is kept as given.

The rest of a state file's format lives next door and is handed on from here under its old
names: what the columns and rows mean (:mod:`storage.tables`), values images of format 4
(:mod:`storage.values_images`), checksums (:mod:`storage.checksums`) and the limits on how far
a file may expand when decoded (:mod:`storage.decode_limits`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import pyarrow as pa

from abscore.schema import (
    KEY_COLUMN,
    META_FILE_KIND,
    META_KEY_ENCODING,
    META_KEYS_DIGEST,
    META_VALUE_ENCODING,
    OP_COLUMN,
    OP_DELETE,
    OP_UPSERT,
)

from .checksums import CHECKSUM_ALGORITHMS, WRITE_CHECKSUM_ALGORITHM, checksum_hex, is_checksum, sha256_hex
from .decode_limits import (
    _FILE_MAGIC,
    DEFAULT_DECODE_LIMITS,
    DecodeLimits,
    _check_decoded_size,
    _unreadable,
    decoded_size,
)
from .tables import delta_for_file, has_deletes, is_pickled, normalize_delta, sort_by_key, value_columns
from .values_images import is_values_image, keys_digest, strictly_increasing, values_image

__all__ = [
    "KEY_COLUMN",
    "OP_COLUMN",
    "OP_UPSERT",
    "OP_DELETE",
    "META_KEY_ENCODING",
    "META_VALUE_ENCODING",
    "META_FILE_KIND",
    "META_KEYS_DIGEST",
    "table_bytes",
    "CHECKSUM_ALGORITHMS",
    "WRITE_CHECKSUM_ALGORITHM",
    "EncodedFile",
    "compression_level",
    "encode_table",
    "prepare_table",
    "encode_prepared",
    "encode_shared",
    "FAST_LEVEL",
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

# has_deletes is not in __all__ but has always been importable from here
_HANDED_ON = (has_deletes,)

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
FAST_LEVEL = _LARGE_TABLE_LEVEL
"""zstd's fastest level, which :func:`encode_prepared` accepts (for size estimates)."""
# One thread: a state file has two or three buffers, and handing them to Arrow's thread pool
# cost more than compressing them in place (64 key-group images of 7.8k int64 rows: 23-26 ms
# of CPU with the pool, 16-20 ms without, and less wall time too).
_WRITE_OPTIONS = {
    level: pa.ipc.IpcWriteOptions(compression=pa.Codec("zstd", compression_level=level), use_threads=False)
    for level in (_SMALL_TABLE_LEVEL, _LARGE_TABLE_LEVEL)
}
_READ_OPTIONS = pa.ipc.IpcReadOptions(use_threads=False)  # decoding one small file: threads only cost


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


def table_bytes(table: pa.Table) -> int:
    """``table``'s in-memory bytes: the size of its buffers, or ``pa.Table.nbytes`` (the bytes
    its rows refer to) when they reach 64 KiB (a slice of larger buffers). ``nbytes`` costs
    ~10 us even for a table of three rows, the buffers' size a tenth of a microsecond: a
    writer asks for it several times per key group. The two differ by a few bytes in a table
    of whole buffers."""
    size = table.get_total_buffer_size()
    return size if size < 64 << 10 else table.nbytes


def compression_level(table: pa.Table, nbytes: int | None = None) -> int:
    """The zstd level :func:`encode_table` compresses ``table``'s buffers with (``nbytes``:
    its :func:`table_bytes`, when known)."""
    return _SMALL_TABLE_LEVEL if (table_bytes(table) if nbytes is None else nbytes) < _SMALL_TABLE_BYTES \
        else _LARGE_TABLE_LEVEL


def encode_table(table: pa.Table, kind: str) -> EncodedFile:
    """Encode ``table`` as an Arrow IPC stream with zstd buffers. Rows of ``base`` and
    ``delta`` tables are sorted by key (see :func:`sort_by_key`); the schema metadata is kept."""
    return encode_prepared(prepare_table(table, kind))


def prepare_table(table: pa.Table, kind: str) -> pa.Table:
    """``table`` as :func:`encode_table` writes it: rows of ``base`` and ``delta`` tables sorted
    by key, one chunk per column."""
    if kind in ("base", "delta"):
        table = sort_by_key(table)
    if any(col.num_chunks > 1 for col in table.columns):
        table = table.combine_chunks()
    return table


def encode_shared(tables: Sequence[pa.Table], *, level: int = _SMALL_TABLE_LEVEL) -> EncodedFile:
    """The rows of ``tables`` (each as :func:`prepare_table` returned it, all of one schema,
    metadata included) one after the other in one Arrow IPC stream: a shared range of a packed
    file (format 6). At the level of small tables (the default), written as record batches of
    about :data:`_SMALL_TABLE_BYTES` each: zstd tunes its parameters to the size of what it
    compresses, and buffers of up to 16 KiB compress better at that level than one large
    buffer (the bases of 18 key groups of 100 k string keys with random 40-bit values: 119 KB
    in 16 KiB batches, 155 KB in one batch, 126 KB as a stream per key group). At
    :data:`FAST_LEVEL` (a writer with much to compress, see
    :data:`storage.store_write.HIGH_LEVEL_LIMIT`), in batches of up to 128 Ki rows: there
    16 KiB batches were both larger and twice as slow."""
    table = pa.concat_tables(tables).combine_chunks()
    if level != _SMALL_TABLE_LEVEL:
        return encode_prepared(table, level=level)
    rows = max(1, table.num_rows * _SMALL_TABLE_BYTES // max(table_bytes(table), 1))
    return encode_prepared(table, level=_SMALL_TABLE_LEVEL, batch_rows=min(rows, _MAX_BATCH_ROWS))


def encode_prepared(table: pa.Table, *, level: int | None = None, batch_rows: int = _MAX_BATCH_ROWS) -> EncodedFile:
    """Encode a table as is (see :func:`prepare_table`); ``level``: the zstd level (default:
    :func:`compression_level`); ``batch_rows``: rows per record batch."""
    level = compression_level(table) if level is None else level
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=_WRITE_OPTIONS[level]) as writer:
        writer.write_table(table, max_chunksize=batch_rows)
    data = sink.getvalue().to_pybytes()
    algorithm = WRITE_CHECKSUM_ALGORITHM
    return EncodedFile(data=data, rows=table.num_rows, checksum=checksum_hex(data, algorithm),
                       checksum_algorithm=algorithm)


def stream_schema(data: bytes, *, source: str) -> pa.Schema:
    """The schema of an encoded file (:func:`decode_table`'s input), from its schema message alone."""
    try:
        opener = pa.ipc.open_file if data[:len(_FILE_MAGIC)] == _FILE_MAGIC else pa.ipc.open_stream
        return opener(pa.BufferReader(data)).schema
    except pa.ArrowMemoryError:
        raise
    except (pa.ArrowException, OSError) as exc:
        raise _unreadable(source, exc) from exc


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
