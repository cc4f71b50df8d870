"""The reader of a planned Spark stream's lanes (:class:`~abs.connectors.spark_stream.SparkStreamSource`):
each batch's partitions read through the user's data source reader, in Arrow chunks."""
from __future__ import annotations

import base64
from typing import Any, Iterator, Mapping

import pyarrow as pa

from .batchlog import _batch_name, _LaneReader
from .spark_arrow import _arrow_chunks


class _StreamLaneReader(_LaneReader):
    unit_key = "partition"

    def __init__(self, source: Any, splits: Mapping[str, Any]) -> None:
        assert source._log is not None
        super().__init__(source._log, splits, source.num_splits, f"SparkStreamSource({source.name})",
                         source._progress_token)
        self._src = source
        self._reader: Any = None

    def _fetch(self, batch: int) -> Any:
        entry = self._log.read_json(self._log.path(_batch_name(batch)))
        if entry is None:
            return None
        import pickle

        return [pickle.loads(base64.b64decode(p)) for p in entry["partitions"]]

    def _exists(self, batch: int) -> bool:
        return self._log.read(self._log.path(_batch_name(batch))) is not None

    def _open_unit(self, batch: int, units: Any, unit: int, skip: int) -> Iterator[pa.RecordBatch]:
        if self._reader is None:
            self._reader = self._src._worker_reader()
        items = self._reader.read(units[unit])
        return _arrow_chunks(iter(items), self._src._arrow_schema, self._src.batch_size, skip, self._what)
