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
import os
import re
import threading
import weakref
from typing import TYPE_CHECKING, Any, Iterator

import pyarrow as pa

from .backend import absolute_url
from .errors import StorageConfigError, StorageError
from .extras import require
from .file_ref import FileRef
from .spark_checkpoints import CHECKPOINT_STAT_COLUMNS, _checkpoints_spark_schema, checkpoints_table
from .spark_options import SOURCE_NAME, _Options, _parse_options
from .spark_partitions import (
    AUTO_MAX_PARTITIONS,
    AUTO_MIN_PARTITION_BYTES,
    AUTO_MIN_PARTITIONS,
    AUTO_PARTITION_BYTES,
    _pack_by_bytes,
    auto_partition_count,
)
from .spark_plan import KEY_GROUP_COLUMN, _plan_state, _StatePlan
from .spark_read import _BATCH_ROWS, _cast, _read_state, _target_schema
from .spark_stores import _open_existing, _open_store
from .spark_types import arrow_to_spark_type

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql import SparkSession
    from pyspark.sql.types import StructType

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


# The parts of the data source live in storage.spark_options, spark_stores, spark_types,
# spark_partitions, spark_plan, spark_read and spark_checkpoints; these names, not in __all__,
# have always been importable from here too.
_HANDED_ON = (AUTO_PARTITION_BYTES, AUTO_MIN_PARTITION_BYTES, AUTO_MIN_PARTITIONS, AUTO_MAX_PARTITIONS,
              _open_store, _pack_by_bytes)


# ============================================================================ registration
_REGISTERED: "weakref.WeakSet[Any]" = weakref.WeakSet()  # sessions the data source is registered with
_REGISTERED_LOCK = threading.Lock()


def register(spark: "SparkSession") -> None:
    """Register the ``abs-snapshot`` data source with ``spark``, once per session: later calls
    with the same session (every :func:`load` calls it) do nothing, so Spark does not warn
    that the source replaces one registered before. A new session (after ``spark.stop()``)
    gets it registered again."""
    require("spark", "storage.spark (the abs-snapshot Spark data source)")
    with _REGISTERED_LOCK:
        if spark in _REGISTERED:
            return
        spark.dataSource.register(_spark_classes()["AbsSnapshotDataSource"])
        _REGISTERED.add(spark)


def load(spark: "SparkSession", root: "str | os.PathLike[str]", **options: Any) -> "Any":
    """``spark.read.format("abs-snapshot").options(**options).load(root)`` (registering the
    source first, once per session: :func:`register`), with the data source's own error raised as itself: Spark reports an error
    of a Python data source as an ``AnalysisException`` whose message starts with Spark's
    words and a Python traceback and ends with the cause; this raises the cause (e.g.
    :class:`storage.errors.CheckpointNotFoundError` with its message), chained to Spark's.

    Errors found later, while an action reads the files, arrive inside Spark's execution
    errors: :func:`cause` finds them there.
    """
    register(spark)
    # a relative path is the caller's: Spark plans and reads in its own Python workers, whose
    # working directory is where the session started (on a cluster, each executor's own)
    if isinstance(root, os.PathLike):
        root = os.fspath(root)
    if not isinstance(root, str):
        raise StorageConfigError(
            f"{SOURCE_NAME}: the snapshot root must be a path or URL (str or pathlib.Path), got "
            f"{type(root).__name__} {root!r}; e.g. load(spark, '/data/ckpt', ...)"
        )
    root = absolute_url(root)
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
