"""Schemas and rows of the Spark sources: a Spark schema (StructType, DDL string) or a pyarrow
schema resolved to both forms, and what a data source's ``read()`` yields (tuples, ``Row``\\ s,
``pyarrow.RecordBatch``\\ es) turned into Arrow batches of that schema. Imports pyspark only
inside the functions that need it.
"""
from __future__ import annotations

from typing import Any, Iterator

import pyarrow as pa

from ..errors import ConfigError
from .batchlog import SparkSourceError

__all__: list[str] = []


def _active_session() -> Any:
    """A live SparkContext's session (``True`` if only the context is known), else ``None``.

    ``SparkSession.getActiveSession()`` is thread-local on the JVM side, and the driver hooks
    may run in another thread than the one that built the session: look at the process-wide
    SparkContext instead."""
    try:
        from pyspark import SparkContext
        from pyspark.sql import SparkSession
    except ImportError:  # pragma: no cover - pyspark is a dependency of this module
        return None
    sc = SparkContext._active_spark_context
    if sc is None or getattr(sc, "_jsc", None) is None:
        return None
    return SparkSession.getActiveSession() or getattr(SparkSession, "_instantiatedSession", None) or True


def _resolve_schema(schema: Any, what: str) -> tuple[Any, pa.Schema]:
    """(StructType, Arrow schema) from a StructType, a DDL string or a pyarrow schema."""
    from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema
    from pyspark.sql.types import StructType

    if isinstance(schema, pa.Schema):
        return from_arrow_schema(schema), schema
    if isinstance(schema, str):
        if _active_session() is None:
            raise ConfigError(
                f"{what}: the schema is the DDL string {schema!r}; parsing DDL needs an active SparkSession. "
                "Create the source while a SparkSession is active, or give the schema as a "
                "pyspark.sql.types.StructType or a pyarrow.Schema (schema=...)"
            )
        try:
            schema = StructType.fromDDL(schema)
        except Exception as exc:  # noqa: BLE001 - Spark's parse errors come in many classes
            raise ConfigError(f"{what}: cannot parse the schema {schema!r}: {exc}") from exc
    if not isinstance(schema, StructType):
        raise ConfigError(
            f"{what}: schema must be a StructType, a DDL string or a pyarrow.Schema, got {type(schema).__name__}"
        )
    try:
        return schema, to_arrow_schema(schema, timezone="UTC")
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(f"{what}: schema {schema.simpleString()} has no Arrow equivalent: {exc}") from exc


def _rows_to_batch(rows: list, schema: pa.Schema, what: str) -> pa.RecordBatch:
    names = schema.names
    columns: list[list] = [[] for _ in names]
    for row in rows:
        fields = getattr(row, "__fields__", None)
        if fields is not None and isinstance(row, tuple):  # a pyspark Row with names
            d = row.asDict()
            try:
                values = [d[n] for n in names]
            except KeyError as exc:
                raise SparkSourceError(f"{what}: read() returned {row!r}, which has no field {exc}") from None
        elif isinstance(row, (tuple, list)):
            values = row
        else:
            raise SparkSourceError(
                f"{what}: read() must yield tuples, Rows or pyarrow.RecordBatch, got {type(row).__name__}: {row!r}"
            )
        if len(values) != len(names):
            raise SparkSourceError(f"{what}: read() returned {row!r} for the schema {names} ({len(names)} fields)")
        for col, v in zip(columns, values):
            col.append(v)
    arrays = []
    for col, field in zip(columns, schema):
        try:
            arrays.append(pa.array(col, type=field.type))
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as exc:
            raise SparkSourceError(
                f"{what}: column {field.name!r} does not fit its declared type {field.type}: {exc}"
            ) from None
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _conform(batch: pa.RecordBatch, schema: pa.Schema, what: str) -> pa.RecordBatch:
    if batch.schema.equals(schema):
        return batch
    try:
        cols = [batch.column(f.name).cast(f.type) for f in schema]
        return pa.RecordBatch.from_arrays(cols, schema=schema)
    except (KeyError, pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
        raise SparkSourceError(
            f"{what}: read() returned a RecordBatch with schema {batch.schema}, expected {schema}: {exc}"
        ) from None


def _arrow_chunks(items: Any, schema: pa.Schema, batch_size: int, skip: int, what: str) -> Iterator[pa.RecordBatch]:
    """Arrow batches of at most ``batch_size`` rows from what ``read()`` yields, after
    skipping the first ``skip`` rows."""
    buf: list = []
    for item in items:
        if isinstance(item, pa.RecordBatch):
            if buf:
                yield _rows_to_batch(buf, schema, what)
                buf = []
            batch = _conform(item, schema, what)
            if skip:
                if skip >= batch.num_rows:
                    skip -= batch.num_rows
                    continue
                batch = batch.slice(skip)
                skip = 0
            for off in range(0, batch.num_rows, batch_size):
                yield batch.slice(off, batch_size)
            continue
        if skip:
            skip -= 1
            continue
        buf.append(item)
        if len(buf) >= batch_size:
            yield _rows_to_batch(buf, schema, what)
            buf = []
    if buf:
        yield _rows_to_batch(buf, schema, what)
