"""Reading a snapshot root's state files back: verified bytes (size and checksum), decoded
tables, schemas, and key-group chains resolved into live rows.

Part of :class:`storage.store.SnapshotStore`: its read methods build a :class:`ChainReader`
over the root and its decode limits and delegate to it; the key-group writer uses one to
read a chain back when it compacts it.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

import pyarrow as pa

from .chains import resolve_chain
from .errors import CorruptFileError, InvalidChainError, MissingFileError, StateNotFoundError, StorageError
from .format import (KEY_COLUMN, OP_COLUMN, DecodeLimits, checksum_hex, decode_table, is_values_image, iter_batches,
                     sort_by_key, stream_schema)
from .manifest import FileRef, Manifest, chain_problems

if TYPE_CHECKING:  # at run time only annotations name it: a job without a storage root skips fsspec
    from .backend import RootIO

__all__ = ["ChainReader", "RESTORE_HINT", "SharedRangeCache", "key_group_chain"]

RESTORE_HINT = "restore from an earlier checkpoint or a savepoint ('abs-snapshot verify ROOT' lists intact ones)"
_REMOTE_READERS = 8  # files of one chain fetched at once from an object store
_SCHEMA_PREFIX = 16 << 10  # bytes read to find a file's schema (its first IPC message)


def key_group_chain(manifest: Manifest, operator: str, state: str, key_group: int) -> list[FileRef]:
    """The chain of one key group in ``manifest``; :class:`StateNotFoundError` when it has none."""
    chains = manifest.chains(operator, state)
    if key_group not in chains:
        raise StateNotFoundError(
            f"checkpoint {manifest.checkpoint_id}: {operator}/{state} has no chain for key group {key_group}; "
            "the key group held no state at this checkpoint"
        )
    return list(chains[key_group])


class SharedRangeCache:
    """The last few shared ranges of packed files (format 6) read, verified bytes and decoded
    table: each holds the rows of many key groups, which a restore reads one after the other.
    Keyed by path, offset, size and checksum; thread-safe; at most ``entries`` ranges (a
    shared range holds at most ``SHARED_RANGE_LIMIT`` bytes of tables)."""

    def __init__(self, entries: int = 8) -> None:
        self._entries = entries
        self._lock = threading.Lock()
        self._data: OrderedDict[tuple, list] = OrderedDict()  # key -> [bytes, table or None]
        self._flights: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # key -> its lock

    @staticmethod
    def key(ref: FileRef) -> tuple:
        return (ref.path, ref.offset, ref.read_size, ref.checksum)

    def flight(self, ref: FileRef) -> threading.Lock:
        """The lock of ``ref``'s range: held while it is fetched or decoded, so that threads
        reading key groups of one range at once (a restore reads ahead) fetch and decode it
        once, the others taking it from the cache."""
        with self._lock:
            lock = self._flights.get(self.key(ref))
            if lock is None:
                lock = self._flights[self.key(ref)] = threading.Lock()
            return lock

    def get(self, ref: FileRef, what: int) -> "bytes | pa.Table | None":
        """The cached bytes (``what`` 0) or decoded table (1) of ``ref``'s range, or ``None``."""
        with self._lock:
            entry = self._data.get(self.key(ref))
            if entry is None:
                return None
            self._data.move_to_end(self.key(ref))
            return entry[what]

    def put(self, ref: FileRef, data: bytes, table: "pa.Table | None" = None) -> None:
        with self._lock:
            entry = self._data.setdefault(self.key(ref), [data, None])
            if table is not None:
                entry[1] = table
            self._data.move_to_end(self.key(ref))
            while len(self._data) > self._entries:
                self._data.popitem(last=False)


@dataclass(frozen=True)
class ChainReader:
    """Verified reads of one root's files, decoded within ``limits``; ``shared`` keeps the
    shared ranges last read."""

    io: RootIO
    limits: DecodeLimits
    shared: SharedRangeCache | None = None

    def read_bytes(self, ref: FileRef, *, checkpoint_id: int | None = None) -> bytes:
        """:meth:`SnapshotStore.read_bytes`: a file's bytes (or its range of a packed file),
        after checking their size and checksum."""
        if not ref.shared or self.shared is None:
            return self._read_bytes(ref, checkpoint_id)
        with self.shared.flight(ref):
            cached = self.shared.get(ref, 0)
            if cached is not None:
                return cached  # type: ignore[return-value]
            data = self._read_bytes(ref, checkpoint_id)
            self.shared.put(ref, data)
            return data

    def _read_bytes(self, ref: FileRef, checkpoint_id: int | None) -> bytes:
        try:
            data = self.io.get(ref.path) if ref.offset is None else self.io.get_range(ref.path, ref.offset, ref.read_size)
        except FileNotFoundError:
            raise MissingFileError(
                f"{self._whose(ref, checkpoint_id)} is missing; the checkpoint cannot be restored; {RESTORE_HINT}"
            ) from None
        if len(data) != ref.read_size:
            if ref.offset is not None:
                try:
                    real = f"{self.io.size(ref.path)} bytes"
                except (FileNotFoundError, StorageError):
                    real = "fewer bytes"
                raise CorruptFileError(
                    f"{self._whose(ref, checkpoint_id)} has {real}, but the manifest's range of key group "
                    f"{ref.key_group} [{ref.offset}, {ref.offset + ref.read_size}) points past its end (torn or truncated "
                    f"write, or a corrupt manifest); the checkpoint cannot be restored; {RESTORE_HINT}"
                )
            raise CorruptFileError(
                f"{self._whose(ref, checkpoint_id)} has {len(data)} bytes, the manifest says {ref.read_size} "
                f"(torn or altered write); the checkpoint cannot be restored; {RESTORE_HINT}"
            )
        if checksum_hex(data, ref.checksum_algorithm) != ref.checksum:
            part = f": key group {ref.key_group}'s range [{ref.offset}, {ref.offset + ref.read_size})" \
                if ref.offset is not None else ""
            raise CorruptFileError(
                f"{self._whose(ref, checkpoint_id)}{part} fails its {ref.checksum_algorithm} checksum; "
                f"the file is corrupt; {RESTORE_HINT}"
            )
        return data

    def read_schema(self, ref: FileRef) -> pa.Schema:
        """:meth:`SnapshotStore.read_schema`: a file's Arrow schema, from its first bytes."""
        head = min(ref.read_size, _SCHEMA_PREFIX)
        source = f"{self.io.url}: file {ref.where}"
        try:
            data = self.io.get_range(ref.path, ref.offset or 0, head)
        except FileNotFoundError:
            raise MissingFileError(f"{self._whose(ref, None)} is missing; {RESTORE_HINT}") from None
        try:
            return stream_schema(data, source=source)
        except CorruptFileError:
            if head == ref.read_size:
                raise
        return stream_schema(self.read_bytes(ref), source=source)  # a schema message longer than the prefix

    def values_images(self, manifest: Manifest, unreadable: list[str] | None = None) -> set[str]:
        """:meth:`SnapshotStore.values_images`: the ids of ``manifest``'s values images, found by
        reading the schema of each chain's second file."""
        seconds = list({chain[1].id: chain[1] for states in manifest.keyed.values() for chains in states.values()
                        for chain in chains.values() if len(chain) > 1 and chain[1].kind == "delta"}.values())

        def is_image(ref: FileRef) -> bool | None:
            try:
                return KEY_COLUMN not in self.read_schema(ref).names
            except StorageError:
                if unreadable is None:
                    raise
                return None

        if self.io.object_store and len(seconds) > 1:
            with ThreadPoolExecutor(max_workers=_REMOTE_READERS, thread_name_prefix="abs-read") as pool:
                flags = list(pool.map(is_image, seconds))
        else:
            flags = [is_image(ref) for ref in seconds]
        if unreadable is not None:
            unreadable.extend(ref.id for ref, flag in zip(seconds, flags) if flag is None)
        return {ref.id for ref, flag in zip(seconds, flags) if flag}

    def _whose(self, ref: FileRef, checkpoint_id: int | None) -> str:
        """``<root>: checkpoint N: file P (written by checkpoint M)`` for error messages."""
        who = f"checkpoint {checkpoint_id if checkpoint_id is not None else ref.checkpoint_id}"
        origin = f" (written by checkpoint {ref.checkpoint_id})" if checkpoint_id not in (None, ref.checkpoint_id) else ""
        return f"{self.io.url}: {who}: file {ref.path}{origin}"

    def read_file(self, ref: FileRef, *, checkpoint_id: int | None = None) -> pa.Table:
        """:meth:`SnapshotStore.read_file`: one file as a table (verified)."""
        return self.decode(ref, self.read_bytes(ref, checkpoint_id=checkpoint_id))

    def decode(self, ref: FileRef, data: bytes, columns: list[str] | None = None) -> pa.Table:
        """``data`` (the bytes of ``ref``) as a table, with the row count the manifest records
        (a key group's rows of a shared range: that range's table sliced)."""
        if ref.shared:
            table = self._decode_shared(ref, data)
            if columns is not None:
                table = table.select([n for n in table.column_names if n in columns])
            return table.slice(ref.row_offset, ref.rows)
        table = decode_table(data, source=f"{self.io.url}: file {ref.where}", columns=columns, limits=self.limits)
        if table.num_rows != ref.rows:
            raise CorruptFileError(
                f"{self.io.url}: file {ref.path} has {table.num_rows} rows, the manifest says {ref.rows}; "
                f"the file or manifest is corrupt; {RESTORE_HINT}"
            )
        return table

    def _decode_shared(self, ref: FileRef, data: bytes) -> pa.Table:
        if self.shared is None:
            return self._decode_range(ref, data)
        with self.shared.flight(ref):
            table = self.shared.get(ref, 1)
            return self._decode_range(ref, data) if table is None else table  # type: ignore[return-value]

    def _decode_range(self, ref: FileRef, data: bytes) -> pa.Table:
        table = decode_table(data, source=f"{self.io.url}: file {ref.where}", limits=self.limits)
        if table.num_rows != ref.range_rows:
            raise CorruptFileError(
                f"{self.io.url}: file {ref.where} holds a shared range of {table.num_rows} rows, the manifest says "
                f"{ref.range_rows}; the file or manifest is corrupt; {RESTORE_HINT}"
            )
        if self.shared is not None:
            self.shared.put(ref, data, table)
        return table

    def read_chain(self, chain: Sequence[FileRef], *, checkpoint_id: int | None = None) -> pa.Table:
        """:meth:`SnapshotStore.read_chain`: ``key`` + value columns, one row per live key."""
        chain = list(chain)
        if not chain:
            raise InvalidChainError("read_chain got an empty chain; pass a chain from a manifest")
        loc = chain[0].location()
        if loc.operator is None or loc.state is None or loc.key_group is None:
            raise InvalidChainError(f"read_chain: {chain[0].path} is not a state file; pass a key group's chain")
        problems = chain_problems(chain, operator=loc.operator, state=loc.state, key_group=loc.key_group)
        if problems:
            raise InvalidChainError(f"read_chain: malformed chain ({problems[0][1]}); pass a chain from a manifest")
        data = self.fetch(chain, checkpoint_id=checkpoint_id)
        rest = [self.decode(ref, d) for ref, d in zip(chain[1:], data[1:])]
        if not (rest and is_values_image(rest[0])):
            return resolve_chain([self.decode(chain[0], data[0]), *rest], first_is_base=True)
        # under a values image the base's values are dead: its keys alone are decoded, and the
        # image's columns are checked against the schema of the base's file
        base = self.decode(chain[0], data[0], [KEY_COLUMN])
        schema = stream_schema(data[0], source=f"{self.io.url}: file {chain[0].path}")
        return resolve_chain([base, *rest], first_is_base=True, base_schema=schema)

    def read_range(self, chains: Sequence[Sequence[FileRef]], *,
                   checkpoint_id: int | None = None) -> tuple[pa.Table, list[tuple[int, int]]]:
        """:meth:`SnapshotStore.read_range`: chains that are each one key group's rows of one
        shared range alone (a base of one reference, the same range in every chain), resolved
        as :meth:`read_chain` resolves each, as one table and each chain's ``(row offset,
        rows)`` in it. The range is fetched, verified and decoded once and resolved as a whole
        (a restore after a full checkpoint of many key groups: one chain of a few rows per
        key group, some thirty ranges for 32,768 key groups); each chain is checked as
        :meth:`read_chain` checks it. :class:`InvalidChainError` for a chain that is not such a
        reference to the first chain's range."""
        chains = [list(chain) for chain in chains]
        if not chains:
            raise InvalidChainError("read_range got no chains; pass chains from a manifest")
        first = chains[0][0] if chains[0] else None
        key = None if first is None or not first.shared else SharedRangeCache.key(first)
        for chain in chains:
            ref = chain[0] if len(chain) == 1 else None
            if ref is None or not ref.shared or SharedRangeCache.key(ref) != key:
                raise InvalidChainError("read_range: a chain is not one reference to the rows of the first chain's "
                                        "shared range; read it with read_chain")
            if ref.kind != "base":
                loc = ref.location()
                problems = chain_problems(chain, operator=loc.operator, state=loc.state,  # type: ignore[arg-type]
                                          key_group=loc.key_group)  # type: ignore[arg-type]
                raise InvalidChainError(f"read_range: malformed chain ({problems[0][1]}); pass a chain from a manifest")
        ref = chains[0][0]
        table = self._decode_shared(ref, self.read_bytes(ref, checkpoint_id=checkpoint_id))
        parts = [(chain[0].row_offset, chain[0].rows) for chain in chains]
        if OP_COLUMN in table.schema.names:  # a base with an op column (not written so): each key group resolved
            tables = [resolve_chain([table.slice(o, n)], first_is_base=True) for o, n in parts]
            parts, at = [], 0
            for t in tables:
                parts.append((at, t.num_rows))
                at += t.num_rows
            return pa.concat_tables(tables) if tables else table.slice(0, 0), parts  # type: ignore[return-value]
        return resolve_chain([table], first_is_base=True), parts  # type: ignore[return-value]

    def read_files(self, refs: Sequence[FileRef], *, checkpoint_id: int | None = None) -> list[pa.Table]:
        """:meth:`read_file` of each ref, in order (fetched as :meth:`fetch` does)."""
        return [self.decode(ref, d) for ref, d in zip(refs, self.fetch(refs, checkpoint_id=checkpoint_id))]

    def fetch(self, refs: Sequence[FileRef], *, checkpoint_id: int | None = None) -> list[bytes]:
        """:meth:`read_bytes` of each ref, in order. From an object store the files are fetched
        (and verified) concurrently: there a request's latency, not the bytes, dominates.
        Local and in-memory files are read one after the other. The first failing file in
        chain order raises."""
        if len(refs) < 2 or not self.io.object_store:
            return [self.read_bytes(ref, checkpoint_id=checkpoint_id) for ref in refs]
        with ThreadPoolExecutor(max_workers=min(len(refs), _REMOTE_READERS), thread_name_prefix="abs-read") as pool:
            return list(pool.map(lambda ref: self.read_bytes(ref, checkpoint_id=checkpoint_id), refs))

    def read_key_group(self, manifest: Manifest, operator: str, state: str, key_group: int) -> pa.Table:
        """:meth:`SnapshotStore.read_key_group`: one key group's state at ``manifest``'s checkpoint."""
        chain = key_group_chain(manifest, operator, state, key_group)
        return self.read_chain(chain, checkpoint_id=manifest.checkpoint_id)

    def iter_key_group(self, manifest: Manifest, operator: str, state: str, key_group: int) -> Iterator[pa.RecordBatch]:
        """:meth:`SnapshotStore.iter_key_group`: a base alone one batch at a time, a longer
        chain resolved as a whole first, its rows sorted by key as a base's are (resolving
        puts the rows a delta changed after the base's others)."""
        cid = manifest.checkpoint_id
        chain = key_group_chain(manifest, operator, state, key_group)
        if len(chain) > 1 or chain[0].shared:
            yield from sort_by_key(self.read_chain(chain, checkpoint_id=cid)).to_batches()
            return
        ref = chain[0]
        problems = chain_problems(chain, operator=operator, state=state, key_group=key_group)
        if problems:
            raise InvalidChainError(f"checkpoint {cid}: malformed chain ({problems[0][1]}); {RESTORE_HINT}")
        data = self.read_bytes(ref, checkpoint_id=cid)
        source = f"{self.io.url}: file {ref.where}"
        if OP_COLUMN in stream_schema(data, source=source).names:  # a base of an old writer: resolve it
            yield from self.read_chain(chain, checkpoint_id=cid).to_batches()
            return
        rows = 0
        for batch in iter_batches(data, source=source, limits=self.limits):
            rows += batch.num_rows
            if rows > ref.rows:
                break
            yield batch
        if rows != ref.rows:
            raise CorruptFileError(f"{self.io.url}: file {ref.where} has {'more than ' if rows > ref.rows else ''}{rows} "
                                   f"rows, the manifest says {ref.rows}; the file or manifest is corrupt; {RESTORE_HINT}")
