"""Read snapshot roots with Spark: a PySpark (4.x) Python data source named ``abs-snapshot``.

::

    import storage.spark
    storage.spark.register(spark)

    # the resolved state of one keyed state at a checkpoint (default: the latest complete one)
    df = (spark.read.format("abs-snapshot")
          .option("operator", "count").option("state", "n")
          .option("checkpoint", 42)                       # optional
          .load("/data/ckpt"))                            # any fsspec URL the executors can reach
    df.groupBy("key_group").count()

    # one row per complete checkpoint: kind, sizes, chain lengths, durations
    spark.read.format("abs-snapshot").option("table", "checkpoints").load("s3://bucket/ckpt")

Columns of the state table: ``key_group`` (int), ``key`` (as stored: e.g. bigint or string;
binary for pickled keys) and the value column(s) as stored (binary for pickled values). The
schema comes from the Arrow schema of the first non-empty file of the state (``op`` dropped).
Every key group's chain (base + deltas) is resolved with :meth:`SnapshotStore.read_chain` on
the executors, which also verifies sizes and checksums (XXH3-128; SHA-256 in format-1
files); ``read()`` yields Arrow record batches.

Options (names are case-insensitive, as always in Spark):

==========================  ==============================================================
``table``                   ``state`` (default) or ``checkpoints``
``checkpoint``              checkpoint id, or ``latest`` (default: the latest complete one,
                            savepoints included)
``operator``, ``state``     the keyed state to read (required for ``table=state``)
``keyGroupsPerPartition``   key groups per Spark partition; default ``auto``: contiguous key
                            groups packed by file bytes into partitions of ~32 MiB, at least
                            16 partitions of >= 1 MiB when the state is that large, at most
                            256 (see ``auto_partition_count``)
``keyGroups``               read only these key groups, e.g. ``0-9,17``
``storage.<name>``          fsspec storage option ``<name>`` (dots nest:
                            ``storage.client_kwargs.endpoint_url``); values are parsed as JSON
                            when they parse, else kept as strings (like ``abs-snapshot -o``)
``storageOptions``          a JSON object of storage options (merged under the ``storage.*``
                            ones); use it for case-sensitive names or string values that
                            look like JSON
==========================  ==============================================================

Executors open the root themselves, so it must be reachable from them with these options
(``memory://`` roots are process-local and do not work). This module imports pyspark only
when a Spark class is used; ``import storage`` never needs it.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa

from .errors import (
    CheckpointNotFoundError,
    StorageConfigError,
    StorageError,
    UnsupportedFormatError,
)
from .extras import require
from .format import KEY_COLUMN, OP_COLUMN, is_pickled, value_columns
from .inspect import parse_storage_options
from .manifest import FileRef, Manifest
from .store import SnapshotStore

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql import SparkSession
    from pyspark.sql.types import DataType, StructType

__all__ = [
    "SOURCE_NAME",
    "KEY_GROUP_COLUMN",
    "register",
    "load",
    "cause",
    "arrow_to_spark_type",
    "checkpoints_table",
    "CHECKPOINT_STAT_COLUMNS",
    "auto_partition_count",
]

SOURCE_NAME = "abs-snapshot"
KEY_GROUP_COLUMN = "key_group"
# keyGroupsPerPartition=auto: contiguous key groups are packed by the bytes of their chains.
# A Spark task of a Python data source costs ~50-100 ms of fixed overhead, while one Python
# worker resolves ~50 MiB/s of snapshot files (~5M rows/s of int64 keys + 100-byte strings):
# reading 1M such rows (11 MiB, 128 key groups) took 8-14 s as 128 one-key-group partitions and
# ~1 s as 8 (scripts/bench_spark_read.py). So: partitions of about AUTO_PARTITION_BYTES, but at
# least AUTO_MIN_PARTITIONS of at least AUTO_MIN_PARTITION_BYTES each (parallelism for mid-sized
# states), at most AUTO_MAX_PARTITIONS, never more than the key groups.
AUTO_PARTITION_BYTES = 32 << 20
AUTO_MIN_PARTITION_BYTES = 1 << 20
AUTO_MIN_PARTITIONS = 16
AUTO_MAX_PARTITIONS = 256
_AUTO_KEY_GROUP_COST = 16 << 10  # per key group: file opens, checksums, Arrow set-up (in bytes)
_BATCH_ROWS = 1 << 16
_KNOWN_OPTIONS = {"path", "table", "checkpoint", "operator", "state", "keygroupsperpartition", "keygroups",
                  "storageoptions"}
_STORAGE_PREFIX = "storage."


# ============================================================================ registration
def register(spark: "SparkSession") -> None:
    """Register the ``abs-snapshot`` data source with ``spark`` (idempotent)."""
    require("spark", "storage.spark (the abs-snapshot Spark data source)")
    spark.dataSource.register(_spark_classes()["AbsSnapshotDataSource"])


def load(spark: "SparkSession", root: str, **options: Any) -> "Any":
    """``spark.read.format("abs-snapshot").options(**options).load(root)`` (registering the
    source first), with the data source's own error raised as itself: Spark reports an error
    of a Python data source as an ``AnalysisException`` whose message starts with Spark's
    words and a Python traceback and ends with the cause; this raises the cause (e.g.
    :class:`storage.errors.CheckpointNotFoundError` with its message), chained to Spark's.

    Errors found later, while an action reads the files, arrive inside Spark's execution
    errors: :func:`cause` finds them there.
    """
    register(spark)
    try:
        return spark.read.format(SOURCE_NAME).options(**{k: str(v) for k, v in options.items()}).load(root)
    except Exception as exc:
        found = cause(exc)
        if found is None:
            raise
        raise found from exc


_CAUSE_LINE = re.compile(r"^(?:storage|recovery)\.errors\.(\w+): (.+)$", re.MULTILINE)


def cause(exc: BaseException) -> StorageError | None:
    """The storage error a Spark exception carries (the last ``storage.errors.X: message``
    line of its text), as an instance of that class; ``None`` when it carries none."""
    from . import errors as storage_errors

    found = _CAUSE_LINE.findall(str(exc))
    if not found:
        return None
    name, message = found[-1]
    cls = getattr(storage_errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, StorageError)):
        cls = StorageError
    return cls(message.strip())


# ============================================================================ options
@dataclass(frozen=True)
class _Options:
    root: str
    table: str
    checkpoint: int | None
    operator: str | None
    state: str | None
    key_groups_per_partition: int | None  # None = auto
    key_groups: frozenset[int] | None
    storage_options: dict[str, Any]


def _parse_options(raw: Mapping[str, Any]) -> _Options:
    opts = {str(k).lower(): v for k, v in raw.items()}
    storage_pairs = [f"{k[len(_STORAGE_PREFIX):]}={v}" for k, v in opts.items() if k.startswith(_STORAGE_PREFIX)]
    unknown = sorted(k for k in opts if k not in _KNOWN_OPTIONS and not k.startswith(_STORAGE_PREFIX))
    if unknown:
        raise StorageConfigError(
            f"{SOURCE_NAME}: unknown option(s) {unknown}; known: table, checkpoint, operator, state, "
            "keyGroupsPerPartition, keyGroups, storageOptions and storage.<fsspec option>"
        )
    root = opts.get("path")
    if not root:
        raise StorageConfigError(f"{SOURCE_NAME}: no snapshot root; pass it to load(), e.g. .load('/data/ckpt')")
    table = str(opts.get("table", "state")).strip().lower()
    if table not in ("state", "checkpoints"):
        raise StorageConfigError(f"{SOURCE_NAME}: option table={opts['table']!r}; use 'state' (default) or 'checkpoints'")

    checkpoint: int | None = None
    raw_cid = opts.get("checkpoint")
    if raw_cid is not None and str(raw_cid).strip().lower() not in ("", "latest"):
        try:
            checkpoint = int(str(raw_cid).strip())
        except ValueError:
            checkpoint = -1
        if checkpoint < 1:
            raise StorageConfigError(
                f"{SOURCE_NAME}: option checkpoint={raw_cid!r}; use a checkpoint id (integer >= 1) or 'latest'"
            )

    per_partition: int | None = None
    raw_per = opts.get("keygroupsperpartition")
    if raw_per is not None and str(raw_per).strip().lower() != "auto":
        try:
            per_partition = int(str(raw_per).strip())
        except ValueError:
            per_partition = 0
        if per_partition < 1:
            raise StorageConfigError(
                f"{SOURCE_NAME}: option keyGroupsPerPartition={raw_per!r}; use an integer >= 1 or 'auto'"
            )

    key_groups = _parse_key_groups(opts["keygroups"]) if opts.get("keygroups") not in (None, "") else None

    storage_options: dict[str, Any] = {}
    if opts.get("storageoptions") not in (None, ""):
        try:
            storage_options = json.loads(opts["storageoptions"])
        except ValueError as exc:
            raise StorageConfigError(f"{SOURCE_NAME}: option storageOptions is not JSON ({exc}); pass a JSON object") from exc
        if not isinstance(storage_options, dict):
            raise StorageConfigError(f"{SOURCE_NAME}: option storageOptions must be a JSON object, got {storage_options!r}")
    try:
        _merge(storage_options, parse_storage_options(storage_pairs))
    except ValueError as exc:
        raise StorageConfigError(f"{SOURCE_NAME}: {exc}; use .option('storage.<name>', value)") from exc

    operator = opts.get("operator")
    state = opts.get("state")
    return _Options(root=str(root), table=table, checkpoint=checkpoint,
                    operator=None if operator is None else str(operator),
                    state=None if state is None else str(state),
                    key_groups_per_partition=per_partition, key_groups=key_groups,
                    storage_options=storage_options)


def _merge(into: dict[str, Any], extra: Mapping[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _parse_key_groups(text: Any) -> frozenset[int]:
    out: set[int] = set()
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            a, b = -1, -2
        if a < 0 or b < a:
            raise StorageConfigError(
                f"{SOURCE_NAME}: option keyGroups={text!r}: {part!r} is not a key group or range; use e.g. '0-9,17'"
            )
        out.update(range(a, b + 1))
    return frozenset(out)


# ============================================================================ opening roots
_STORES: dict[tuple[str, str], SnapshotStore] = {}
_STORES_LOCK = threading.Lock()


def _open_store(root: str, storage_options: Mapping[str, Any], *, cached: bool = False) -> SnapshotStore:
    """Open a root; with ``cached`` (executors), reuse one store per root and options in this
    Python worker (s3fs sessions are expensive to build; stores are thread-safe)."""
    if not cached:
        return SnapshotStore.open(root, storage_options)
    key = (root, json.dumps(storage_options, sort_keys=True, default=str))
    with _STORES_LOCK:
        store = _STORES.get(key)
    if store is None:
        store = SnapshotStore.open(root, storage_options, check=False)
        with _STORES_LOCK:
            store = _STORES.setdefault(key, store)
    return store


def _open_existing(opts: _Options) -> SnapshotStore:
    store = _open_store(opts.root, opts.storage_options)
    if not store.exists():
        raise StorageError(
            f"{opts.root}: holds no snapshots (no _job.json, no manifests); check the path or URL "
            "(and the storage.* options)"
        )
    return store


# ============================================================================ types
def arrow_to_spark_type(t: pa.DataType, *, where: str = "column") -> "DataType":
    """The Spark type a column of Arrow type ``t`` is read as.

    Unsigned integers widen (``uint64`` becomes ``decimal(20,0)``), large/view strings and
    binaries become string/binary, dictionaries their value type, timestamps with a time
    zone ``timestamp``, without one ``timestamp_ntz`` (microseconds), durations
    ``interval day to second``. Nested fields are declared nullable. Raises
    :class:`StorageError` for types Spark has no equivalent for.
    """
    from pyspark.sql import types as T

    types = pa.types
    if types.is_dictionary(t):
        return arrow_to_spark_type(t.value_type, where=where)
    if types.is_boolean(t):
        return T.BooleanType()
    simple = {
        pa.int8(): T.ByteType(), pa.int16(): T.ShortType(), pa.int32(): T.IntegerType(), pa.int64(): T.LongType(),
        pa.uint8(): T.ShortType(), pa.uint16(): T.IntegerType(), pa.uint32(): T.LongType(),
        pa.uint64(): T.DecimalType(20, 0),
        pa.float16(): T.FloatType(), pa.float32(): T.FloatType(), pa.float64(): T.DoubleType(),
        pa.date32(): T.DateType(), pa.date64(): T.DateType(), pa.null(): T.NullType(),
    }
    if t in simple:
        return simple[t]
    if types.is_string(t) or types.is_large_string(t) or _is(t, "is_string_view"):
        return T.StringType()
    if (types.is_binary(t) or types.is_large_binary(t) or types.is_fixed_size_binary(t)
            or _is(t, "is_binary_view")):
        return T.BinaryType()
    if types.is_timestamp(t):
        return T.TimestampType() if t.tz is not None else T.TimestampNTZType()
    if types.is_duration(t):
        return T.DayTimeIntervalType()
    if (types.is_time32(t) or types.is_time64(t)) and hasattr(T, "TimeType"):
        return T.TimeType()
    if types.is_decimal(t):
        if t.precision > 38:
            raise StorageError(f"{where}: Arrow type {t} has more digits than Spark decimals (38); "
                               "read this state with pyarrow (storage.SnapshotStore.read_key_group)")
        return T.DecimalType(t.precision, t.scale)
    if types.is_list(t) or types.is_large_list(t) or types.is_fixed_size_list(t) or _is(t, "is_list_view") \
            or _is(t, "is_large_list_view"):
        return T.ArrayType(arrow_to_spark_type(t.value_type, where=f"{where} element"), containsNull=True)
    if types.is_map(t):
        return T.MapType(arrow_to_spark_type(t.key_type, where=f"{where} map key"),
                         arrow_to_spark_type(t.item_type, where=f"{where} map value"), valueContainsNull=True)
    if types.is_struct(t):
        return T.StructType([
            T.StructField(t.field(i).name, arrow_to_spark_type(t.field(i).type, where=f"{where}.{t.field(i).name}"),
                          nullable=True)
            for i in range(t.num_fields)
        ])
    raise StorageError(
        f"{where}: Arrow type {t} has no Spark equivalent; read this state with pyarrow "
        "(storage.SnapshotStore.read_key_group) instead"
    )


def _is(t: pa.DataType, predicate: str) -> bool:
    check = getattr(pa.types, predicate, None)
    return bool(check and check(t))


def _encoding(schema: pa.Schema, column: str) -> str:
    return "pickle" if is_pickled(schema, column) else "arrow"


# ============================================================================ state: planning
@dataclass
class _StatePlan:
    """Everything the executors need to read one keyed state at one checkpoint (picklable)."""

    root: str
    storage_options: dict[str, Any]
    checkpoint_id: int
    operator: str
    state: str
    chains: list[tuple[int, list[FileRef]]]   # key group -> chain, sorted by key group
    arrow_schema: pa.Schema                    # key + value columns as in the sample file
    encodings: dict[str, str]                  # column -> "arrow" | "pickle"
    schema_from: str                           # where the schema was taken from (for errors)
    key_groups_per_partition: int | None      # None: pack by bytes (auto)

    def spark_schema(self) -> "StructType":
        from pyspark.sql.types import IntegerType, StructField, StructType

        fields = [StructField(KEY_GROUP_COLUMN, IntegerType(), nullable=False)]
        for f in self.arrow_schema:
            where = f"{self.operator}/{self.state} column {f.name!r}"
            fields.append(StructField(f.name, arrow_to_spark_type(f.type, where=where),
                                      nullable=f.name != KEY_COLUMN,
                                      metadata={"abs.encoding": self.encodings[f.name]}))
        return StructType(fields)

    def partition_groups(self) -> list[list[tuple[int, list[FileRef]]]]:
        """Contiguous runs of key groups, one per Spark partition."""
        n = self.key_groups_per_partition
        if n is not None:
            return [self.chains[i:i + n] for i in range(0, len(self.chains), n)]
        return _pack_by_bytes(self.chains)


def _chain_bytes(chain: Sequence[FileRef]) -> int:
    return sum(ref.bytes for ref in chain) + _AUTO_KEY_GROUP_COST


def auto_partition_count(total_bytes: int, key_groups: int) -> int:
    """How many partitions ``keyGroupsPerPartition=auto`` aims for (see the constants above)."""
    if key_groups == 0:
        return 0
    wanted = max(math.ceil(total_bytes / AUTO_PARTITION_BYTES),
                 min(AUTO_MIN_PARTITIONS, total_bytes // AUTO_MIN_PARTITION_BYTES))
    return int(max(1, min(wanted, AUTO_MAX_PARTITIONS, key_groups)))


def _pack_by_bytes(chains: list[tuple[int, list[FileRef]]]) -> list[list[tuple[int, list[FileRef]]]]:
    """Contiguous runs of key groups of about equal bytes (a big key group stays alone; the
    share of the others is recomputed after each run)."""
    sizes = [_chain_bytes(chain) for _, chain in chains]
    parts_left = auto_partition_count(sum(sizes), len(chains))
    bytes_left = float(sum(sizes))
    groups: list[list[tuple[int, list[FileRef]]]] = []
    i = 0
    while i < len(chains):
        share = bytes_left / parts_left
        group, filled = [chains[i]], sizes[i]
        i += 1
        while i < len(chains) and (parts_left == 1 or filled + sizes[i] / 2 <= share):
            group.append(chains[i])
            filled += sizes[i]
            i += 1
        groups.append(group)
        bytes_left -= filled
        parts_left = max(1, parts_left - 1)
    return groups


def _resolve_checkpoint(store: SnapshotStore, opts: _Options) -> Manifest:
    if opts.checkpoint is None:
        latest = store.latest_checkpoint()
        if latest is None:
            raise CheckpointNotFoundError(
                f"{opts.root}: has no complete checkpoint yet (no manifest parses); wait for one, or check the root"
            )
        return store.read_manifest(latest)
    return store.read_manifest(opts.checkpoint)


def _available_states(manifest: Manifest) -> str:
    pairs = [f"{op!r}/{st!r}" for op, states in sorted(manifest.keyed.items()) for st in sorted(states)]
    return ", ".join(pairs) if pairs else "none"


def _plan_state(opts: _Options) -> _StatePlan:
    store = _open_existing(opts)
    manifest = _resolve_checkpoint(store, opts)
    cid = manifest.checkpoint_id
    if opts.operator is None or opts.state is None:
        missing = " and ".join(n for n, v in (("operator", opts.operator), ("state", opts.state)) if v is None)
        raise StorageConfigError(
            f"{opts.root}: checkpoint {cid}: option {missing} missing; keyed states at this checkpoint "
            f"(operator/state): {_available_states(manifest)}; pass .option('operator', UID).option('state', NAME) "
            "or .option('table', 'checkpoints')"
        )
    chains_by_kg = manifest.chains(opts.operator, opts.state)  # StateNotFoundError lists what exists
    if opts.key_groups is not None:
        outside = sorted(kg for kg in opts.key_groups if kg >= manifest.max_parallelism)
        if outside:
            raise StorageConfigError(
                f"{SOURCE_NAME}: option keyGroups names key group(s) {outside[:10]} outside [0, "
                f"{manifest.max_parallelism}) of job {manifest.job_name!r}; fix the option"
            )
        chains_by_kg = {kg: c for kg, c in chains_by_kg.items() if kg in opts.key_groups}
    chains = sorted(chains_by_kg.items())

    schema, schema_from = _sample_schema(store, manifest, opts.operator, opts.state)
    names = [n for n in schema.names if n != OP_COLUMN]
    if KEY_COLUMN not in names:
        raise StorageError(f"{opts.root}: checkpoint {cid}: {schema_from} has no 'key' column (columns {schema.names}); "
                           "the file is not keyed state")
    values = value_columns(schema)
    if KEY_GROUP_COLUMN in values:
        raise StorageError(f"{opts.root}: checkpoint {cid}: {opts.operator}/{opts.state} has a value column named "
                           f"{KEY_GROUP_COLUMN!r}, which this reader adds itself; read it with pyarrow instead")
    arrow_schema = pa.schema([schema.field(KEY_COLUMN)] + [schema.field(v) for v in values],
                             metadata=schema.metadata)
    encodings = {n: _encoding(schema, n) for n in arrow_schema.names}

    per = opts.key_groups_per_partition
    return _StatePlan(root=opts.root, storage_options=opts.storage_options, checkpoint_id=cid,
                      operator=opts.operator, state=opts.state, chains=chains, arrow_schema=arrow_schema,
                      encodings=encodings, schema_from=schema_from, key_groups_per_partition=per)


def _sample_schema(store: SnapshotStore, manifest: Manifest, operator: str, state: str) -> tuple[pa.Schema, str]:
    """Schema of the state's first non-empty file (a base if any has rows), by key group."""
    chains = sorted(manifest.chains(operator, state).items())
    refs = [(kg, ref) for kg, chain in chains for ref in chain]
    picked = (next(((kg, r) for kg, r in refs if r.kind == "base" and r.rows > 0), None)
              or next(((kg, r) for kg, r in refs if r.rows > 0), None)
              or (refs[0] if refs else None))
    if picked is None:  # the state exists but holds no key group: an empty table of pickled keys/values
        return (pa.schema([pa.field(KEY_COLUMN, pa.binary()), pa.field("value", pa.binary())]),
                "the default schema (the state has no key groups)")
    kg, ref = picked
    table = store.read_file(ref, checkpoint_id=manifest.checkpoint_id)
    return table.schema, f"key group {kg} ({ref.path})"


# ============================================================================ state: reading
def _target_schema(spark_schema: "StructType") -> pa.Schema:
    """The exact Arrow schema Spark checks the record batches of a Python data source against."""
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(spark_schema, timezone="UTC")


def _cast(column: pa.ChunkedArray, target: pa.DataType) -> pa.ChunkedArray:
    if column.type == target:
        return column
    if pa.types.is_timestamp(column.type) or pa.types.is_time64(column.type) or pa.types.is_time32(column.type):
        return column.cast(target, safe=False)  # Spark keeps microseconds: nanoseconds truncate
    return column.cast(target)


def _conform(plan: _StatePlan, kg: int, table: pa.Table, target: pa.Schema) -> pa.Table:
    """The resolved table of key group ``kg`` with the declared columns and exact Arrow types."""
    where = (f"{plan.root}: checkpoint {plan.checkpoint_id}: {plan.operator}/{plan.state} key group {kg}")
    stored = [n for n in table.schema.names if n != OP_COLUMN]
    for name in stored:
        if name in plan.encodings and _encoding(table.schema, name) != plan.encodings[name]:
            raise StorageError(
                f"{where}: column {name!r} is {_encoding(table.schema, name)}-encoded "
                f"({table.schema.field(name).type}), but the DataFrame schema, taken from {plan.schema_from}, "
                f"declares it {plan.encodings[name]}-encoded ({plan.arrow_schema.field(name).type}); the state mixes "
                "key or value types across key groups; read such key groups separately (option keyGroups) or with pyarrow"
            )
    arrays = []
    for f in target:
        if f.name == KEY_GROUP_COLUMN:
            arrays.append(pa.array(np.full(table.num_rows, kg, dtype=np.int32), f.type))
            continue
        if f.name not in stored:
            raise StorageError(
                f"{where}: has columns {stored}, but the DataFrame schema (from {plan.schema_from}) "
                f"has column {f.name!r}; the state's schema changed across key groups; read it with pyarrow"
            )
        try:
            arrays.append(_cast(table.column(f.name), f.type))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
            raise StorageError(
                f"{where}: column {f.name!r} of type {table.schema.field(f.name).type} does not convert to "
                f"{f.type} as declared (schema from {plan.schema_from} or given with .schema()): {exc}"
            ) from exc
    return pa.Table.from_arrays(arrays, schema=target)


def _read_state(plan: _StatePlan, group: Sequence[tuple[int, list[FileRef]]], spark_schema: "StructType",
                ) -> Iterator[pa.RecordBatch]:
    """Resolve the chains of ``group`` and yield record batches matching ``spark_schema``."""
    target = _target_schema(spark_schema)
    store = _open_store(plan.root, plan.storage_options, cached=True)
    for kg, chain in group:
        table = store.read_chain(chain, checkpoint_id=plan.checkpoint_id)
        if table.num_rows == 0:
            continue
        yield from _conform(plan, kg, table, target).to_batches(max_chunksize=_BATCH_ROWS)


# ============================================================================ checkpoints table
CHECKPOINT_STAT_COLUMNS: tuple[tuple[str, str], ...] = (
    # storage figures (storage.stats.STORAGE_STAT_KEYS)
    ("bytes_written", "long"), ("files_written", "long"), ("full_size", "long"), ("files", "long"),
    ("key_groups", "long"), ("base_bytes", "long"), ("delta_bytes", "long"), ("max_chain_length", "int"),
    ("mean_chain_length", "double"), ("space_amplification", "double"), ("restore_files", "long"),
    ("restore_bytes", "long"),
    # runtime figures (absent: null)
    ("duration_s", "double"), ("alignment_s", "double"), ("sync_s", "double"), ("async_s", "double"),
    ("async_cpu_s", "double"),
    ("parallelism", "int"), ("mode", "string"),
)
"""Columns taken from ``Manifest.stats`` (name, type) by the checkpoints table."""

_ARROW_OF = {"long": pa.int64(), "int": pa.int32(), "double": pa.float64(), "string": pa.string()}


def _checkpoints_arrow_schema() -> pa.Schema:
    return pa.schema(
        [pa.field("checkpoint_id", pa.int64(), nullable=False), pa.field("kind", pa.string()),
         pa.field("job_name", pa.string()), pa.field("max_parallelism", pa.int32()),
         pa.field("created_at", pa.timestamp("us", tz="UTC"))]
        + [pa.field(name, _ARROW_OF[kind]) for name, kind in CHECKPOINT_STAT_COLUMNS]
        + [pa.field("savepoint_of", pa.int64()), pa.field("stats", pa.string()), pa.field("error", pa.string())]
    )


def _stat(value: Any, kind: str) -> Any:
    if value is None or isinstance(value, bool):
        return None
    if kind in ("long", "int"):
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return None
    if kind == "double":
        return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None
    return value if isinstance(value, str) else json.dumps(value, default=str)


def checkpoints_table(store: SnapshotStore) -> pa.Table:
    """One row per complete checkpoint of ``store`` (what ``table=checkpoints`` returns).

    Stats the runtime did not write are null; ``stats`` holds all of ``Manifest.stats`` as
    JSON. A manifest this version cannot read (newer format) gives a row with ``error`` set.
    """
    rows: dict[str, list[Any]] = {name: [] for name in _checkpoints_arrow_schema().names}
    for cid in store.list_checkpoints():
        try:
            m = store.read_manifest(cid)
            error = None
        except (UnsupportedFormatError, StorageError) as exc:
            m, error = None, str(exc)
        stats = m.stats if m is not None else {}
        row: dict[str, Any] = {
            "checkpoint_id": int(cid),
            "kind": m.kind if m else None,
            "job_name": m.job_name if m else None,
            "max_parallelism": m.max_parallelism if m else None,
            "created_at": int(round(m.created_at * 1_000_000)) if m else None,
            "savepoint_of": _stat((stats.get("savepoint_of") or {}).get("checkpoint_id")
                                  if isinstance(stats.get("savepoint_of"), dict) else None, "long"),
            "stats": json.dumps(stats, sort_keys=True, default=str) if m else None,
            "error": error,
        }
        for name, kind in CHECKPOINT_STAT_COLUMNS:
            row[name] = _stat(stats.get(name), kind)
        for name in rows:
            rows[name].append(row[name])
    schema = _checkpoints_arrow_schema()
    return pa.Table.from_arrays([pa.array(rows[f.name], f.type) for f in schema], schema=schema)


def _checkpoints_spark_schema() -> "StructType":
    from pyspark.sql.types import StructField, StructType

    return StructType([StructField(f.name, arrow_to_spark_type(f.type), nullable=f.nullable)
                       for f in _checkpoints_arrow_schema()])


# ============================================================================ Spark classes (lazy)
_CLASSES: dict[str, type] = {}
_CLASSES_LOCK = threading.Lock()


def _spark_classes() -> dict[str, type]:
    """Build the pyspark subclasses on first use and publish them as module attributes, so
    that pickle finds them by name (``storage.spark.AbsSnapshotDataSource``) on executors."""
    with _CLASSES_LOCK:
        if _CLASSES:
            return _CLASSES
        require("spark", "storage.spark (the abs-snapshot Spark data source)")
        from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

        class AbsSnapshotDataSource(DataSource):
            """``spark.read.format("abs-snapshot")``: see :mod:`storage.spark`."""

            @classmethod
            def name(cls) -> str:
                return SOURCE_NAME

            def _opts(self) -> _Options:
                cached = self.__dict__.get("_abs_opts")
                if cached is None:
                    cached = self.__dict__["_abs_opts"] = _parse_options(dict(self.options))
                return cached

            def _plan(self) -> _StatePlan:
                plan = self.__dict__.get("_abs_plan")
                if plan is None:  # planned once, in schema(); the instance travels pickled to reader()
                    plan = self.__dict__["_abs_plan"] = _plan_state(self._opts())
                return plan

            def schema(self) -> "StructType":
                opts = self._opts()
                if opts.table == "checkpoints":
                    _open_existing(opts)
                    return _checkpoints_spark_schema()
                return self._plan().spark_schema()

            def reader(self, schema: "StructType") -> DataSourceReader:
                opts = self._opts()
                if opts.table == "checkpoints":
                    return AbsCheckpointsReader(opts, schema)
                plan = self._plan()
                declared = {KEY_GROUP_COLUMN, *plan.arrow_schema.names}
                unknown = [n for n in schema.names if n not in declared]
                if unknown:
                    raise StorageConfigError(
                        f"{SOURCE_NAME}: the schema given with .schema() has column(s) {unknown}; "
                        f"{plan.operator}/{plan.state} has {sorted(declared)}"
                    )
                return AbsStateReader(plan, schema)

        class AbsKeyGroupPartition(InputPartition):
            """Key groups (with their chains) one Spark task resolves."""

            def __init__(self, index: int, chains: list[tuple[int, list[FileRef]]]) -> None:
                super().__init__(index)
                self.chains = chains

            def __repr__(self) -> str:
                kgs = [kg for kg, _ in self.chains]
                return f"AbsKeyGroupPartition({self.value}, key_groups={kgs[:8]}{'...' if len(kgs) > 8 else ''})"

        class AbsStateReader(DataSourceReader):
            def __init__(self, plan: _StatePlan, schema: "StructType") -> None:
                # the chains travel with the partitions only: the reader is shipped to every task
                self.plan = dataclasses.replace(plan, chains=[])
                self.schema = schema
                self._groups = plan.partition_groups()

            def __getstate__(self) -> dict[str, Any]:
                state = dict(self.__dict__)
                state.pop("_groups", None)
                return state

            def partitions(self) -> list[InputPartition]:
                return [AbsKeyGroupPartition(i, group) for i, group in enumerate(self._groups)]

            def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
                return _read_state(self.plan, getattr(partition, "chains", []), self.schema)

        class AbsCheckpointsReader(DataSourceReader):
            def __init__(self, opts: _Options, schema: "StructType") -> None:
                self.opts = opts
                self.schema = schema

            def partitions(self) -> list[InputPartition]:
                return [InputPartition(0)]

            def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
                table = checkpoints_table(_open_existing(self.opts))
                target = _target_schema(self.schema)
                missing = [n for n in target.names if n not in table.column_names]
                if missing:
                    raise StorageConfigError(f"{SOURCE_NAME}: the checkpoints table has no column(s) {missing}")
                table = pa.Table.from_arrays([_cast(table.column(f.name), f.type) for f in target], schema=target)
                yield from table.to_batches(max_chunksize=_BATCH_ROWS)

        built = {
            "AbsSnapshotDataSource": AbsSnapshotDataSource,
            "AbsKeyGroupPartition": AbsKeyGroupPartition,
            "AbsStateReader": AbsStateReader,
            "AbsCheckpointsReader": AbsCheckpointsReader,
        }
        for name, cls in built.items():
            cls.__module__ = __name__
            cls.__qualname__ = name
            globals()[name] = cls
        _CLASSES.update(built)
        return _CLASSES


def __getattr__(name: str) -> Any:
    if name in ("AbsSnapshotDataSource", "AbsKeyGroupPartition", "AbsStateReader", "AbsCheckpointsReader"):
        return _spark_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
