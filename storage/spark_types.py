"""Spark types of stored columns: the Spark type an Arrow column is read as, and whether a
column holds Arrow values or pickled objects (its encoding)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import pyarrow as pa

from .errors import StorageError
from .tables import is_pickled

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql.types import DataType

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
