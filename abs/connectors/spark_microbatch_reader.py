"""The reader of a micro-batch log's lanes (:class:`~abs.connectors.spark_microbatch.SparkMicroBatchSource`):
Parquet parts per batch, and the lag in rows (staged for its lanes, not yet emitted)."""
from __future__ import annotations

import io
import time
from typing import Any, Iterator, Mapping

import pyarrow as pa

from .batchlog import SparkSourceError, _LaneReader, _stage_dir

class _MicroBatchLaneReader(_LaneReader):
    unit_key = "part"

    def __init__(self, source: Any, splits: Mapping[str, Any]) -> None:
        assert source._log is not None
        super().__init__(source._log, splits, source.num_splits, "SparkMicroBatchSource", source._progress_token)
        self._src = source
        self._before: dict[int, list[int]] = {}  # lanes_before of the batches fetched
        self._staged: tuple[int, list[int]] | None = None  # (newest batch, rows per lane) of _staged.json
        self._staged_at = float("-inf")
        self._lag: float | None = None

    def _fetch(self, batch: int) -> Any:
        manifest = self._log.read_json(self._log.path(_stage_dir(batch), "_manifest.json"))
        if manifest is None:
            return None
        if "lanes_before" in manifest:
            self._before[batch] = manifest["lanes_before"]
        return manifest["parts"]

    # -- lag (rows; see the module docstring)
    def lag(self) -> float | None:
        """Rows staged for this reader's lanes that it has not emitted yet, as of its last
        poll (``None`` until it knows: batches staged by an earlier release carry no counts)."""
        return self._lag

    def poll(self) -> Any:
        got = super().poll()
        self._update_lag()
        return got

    def _update_lag(self) -> None:
        now = time.monotonic()
        if now - self._staged_at >= 0.5:
            self._staged_at = now
            staged = self._log.read_json(self._log.path("_staged.json"))
            if staged is not None:
                self._staged = (int(staged["batch"]), [int(r) for r in staged["lane_rows"]])
        if self._staged is None:
            return
        high, totals = self._staged
        lag = 0
        for lane, (b, j, r) in self._cursors.items():
            total = totals[int(lane)]
            if b > high:
                continue  # read everything staged (as of _staged.json)
            if b not in self._before or b not in self._cache:
                units = self._fetch(b)
                if units is None or b not in self._before:
                    return  # not readable, or staged without counts: keep the last estimate
                self._cache[b] = units
            parts = self._cache[b]
            first = (int(lane) - b) % self._n
            read = self._before[b][int(lane)] + sum(int(parts[k]["rows"]) for k in range(first, min(j, len(parts)), self._n))
            lag += max(0, total - read - r)
        self._lag = float(lag)
        for old in [k for k in self._before if k < min(c[0] for c in self._cursors.values())]:
            del self._before[old]

    def _exists(self, batch: int) -> bool:
        return self._log.read(self._log.path(_stage_dir(batch), "_manifest.json")) is not None

    def _open_unit(self, batch: int, units: Any, unit: int, skip: int) -> Iterator[pa.RecordBatch]:
        import pyarrow.parquet as pq

        path = self._log.path(_stage_dir(batch), units[unit]["file"])
        data = self._log.read(path)
        if data is None:
            raise SparkSourceError(
                f"SparkMicroBatchSource: staged part {path} is missing; something deleted the staging directory"
            )
        table = pq.read_table(io.BytesIO(data))
        if skip:
            table = table.slice(skip)
        return iter(table.to_batches(max_chunksize=self._src.batch_size))
