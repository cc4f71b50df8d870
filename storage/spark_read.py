"""Reading a planned keyed state on the executors: resolve each key group's chain and
yield Arrow record batches with exactly the columns and types of the DataFrame's schema."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np
import pyarrow as pa

from abscore.schema import OP_COLUMN

from .errors import CheckpointNotFoundError, MissingFileError, StorageError
from .file_ref import FileRef
from .spark_plan import KEY_GROUP_COLUMN, _StatePlan
from .spark_stores import _open_store
from .spark_types import _encoding

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql.types import StructType

_BATCH_ROWS = 1 << 16


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
        try:
            table = store.read_chain(chain, checkpoint_id=plan.checkpoint_id)
        except MissingFileError:
            if not store.dropped_meanwhile([plan.checkpoint_id], patience=1.0):
                raise
            raise CheckpointNotFoundError(
                f"{plan.root}: checkpoint {plan.checkpoint_id} was removed while Spark read it (its manifest was "
                "deleted by a GC meanwhile, e.g. the retention of a job writing this root): gone, not damaged; "
                "read again (the latest checkpoint then), or read a savepoint (kept until deleted), or keep more "
                "checkpoints (CheckpointConfig.retained)"
            ) from None
        if table.num_rows == 0:
            continue
        yield from _conform(plan, kg, table, target).to_batches(max_chunksize=_BATCH_ROWS)
