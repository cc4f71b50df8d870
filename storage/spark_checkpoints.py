"""The checkpoints table of the ``abs-snapshot`` data source (``table=checkpoints``): one row
per complete checkpoint, with its kind, sizes, chain lengths and durations."""
from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from .errors import StorageError, UnsupportedFormatError
from .spark_types import arrow_to_spark_type
from .store import SnapshotStore

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql.types import StructType

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
