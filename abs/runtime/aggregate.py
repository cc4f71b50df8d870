"""The vectorized keyed aggregate (``KeyedStream.aggregate``): the per-batch logic of
:class:`abs.runtime.operators.AggregateOp`. Its state lives in an
:class:`~abs.state.aggregate_backend.AggregateBackend`: the columnar store
(:mod:`abs.state.columnar`) for integer, string and binary keys, the dict backend for other
keys.

Columnar path (the key column has an Arrow integer, string or binary type)
==========================================================================
A batch is folded in without any group-by: every row is looked up (new keys are deduplicated
with a sort and inserted; string and binary keys by an int64 code, see
:meth:`~abs.state.columnar.ColumnarKeyedState.slots_for_var`), then ``np.add.at`` / ``np.minimum.at`` / ``np.maximum.at``
(``np.fmin.at`` / ``np.fmax.at`` for floats: NaN is ignored unless a key only ever saw NaN,
like Arrow's ``min``/``max``) fold the rows straight into the accumulators; null inputs are
skipped (``count`` counts non-null values; a key whose inputs were all null holds a null
``sum``/``min``/``max``, like pyarrow's ``group_by``). ``emit="updates"`` then emits one row per
distinct key of the batch, in order of first appearance (Arrow's hash group-by, used by the
dict path, mostly but not always orders groups that way). Integer sums are exact int64 (they
wrap on overflow, as Arrow's per-batch sums do); float sums add row by row, so their last bits
may differ from the dict path's per-batch partial sums.

Dict path
=========
Each batch is grouped with pyarrow's ``group_by``, its keys sorted by key group once, and each
key group's partial results are folded into the dict backend's columns with one numpy
operation (``KeyedStateBackend.fold_many``, :meth:`abs.columns.Column.fold`); where that does
not apply (nulls, an int64 sum nearing the int64 range, untyped or narrower states) they are
merged key by key with ``get_many``/``put_many``.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import GraphError, StateError
from ..keygroups import key_groups
from ..state.aggregate_backend import AggregateBackend
from ..state.columnar import ColumnarKeyedState, StateColumn, acc_dtype
from ..state.dict_backend import KeyedStateBackend
from ..state.keyindex import INT64_MAX, distinct_inverse, first_occurrences
from ..state.varkeys import var_key_kind

__all__ = ["Aggregator"]

_EMIT_TYPE = {np.dtype(np.float64): pa.float64(), np.dtype(np.int64): pa.int64(), np.dtype(np.uint64): pa.uint64()}
_SUM_RECHECK = 2.0**62  # the bound of int64 sums is recomputed exactly past this
_SUM_LIMIT = 2.0**63 * 0.999  # margin for float rounding


class Aggregator:
    """Per-batch logic of the aggregate operator (the runtime class is
    :class:`abs.runtime.operators.AggregateOp`). ``process`` returns the update batch or None."""

    def __init__(self, node: Any, dict_backend: KeyedStateBackend, columnar: bool = True) -> None:
        self.uid = node.uid
        self.aggs: dict = node.spec["aggregations"]
        self.key = node.inputs[0].key
        self.emit_updates = node.spec["emit"] == "updates"
        self.value_type: pa.DataType = node.spec["value_type"]
        self.max_parallelism = dict_backend.max_parallelism
        self.plan: list[tuple[str, str, str]] = []  # (state, input column, fn)
        for out, (col, fn) in self.aggs.items():
            if fn == "mean":
                self.plan += [(f"{out}.sum", col, "sum"), (f"{out}.count", col, "count")]
            else:
                self.plan.append((out, col, fn))
        self.requests: list[tuple[str, str]] = []
        for _s, col, fn in self.plan:
            if (col, fn) not in self.requests:
                self.requests.append((col, fn))
        types = {d.name: d.type for d in dict_backend.descriptors}
        self.dtypes = {s: acc_dtype(types[s]) for s, _c, _f in self.plan}
        inits = {}
        for state, _col, fn in self.plan:
            dt = self.dtypes[state]
            if fn == "min":
                inits[state] = np.nan if dt.kind == "f" else np.iinfo(dt).max
            elif fn == "max":
                inits[state] = np.nan if dt.kind == "f" else np.iinfo(dt).min
            else:
                inits[state] = 0
        self.backend = AggregateBackend(dict_backend, inits, columnar)
        self._schema: pa.Schema | None = None
        self._columnar_schema = False
        self._key_kind: str | None = None  # "int", "string", "binary" (None: other keys)

    # ------------------------------------------------------------------ schema checks
    def _check_schema(self, schema: pa.Schema) -> None:
        if self._schema is not None and (schema is self._schema or schema.equals(self._schema)):
            return
        for out, (col, fn) in self.aggs.items():
            if schema.get_field_index(col) < 0:
                raise GraphError(
                    f"operator {self.uid!r}: aggregation {out!r} reads column {col!r}, which is not in the stream "
                    f"(columns: {', '.join(schema.names)})"
                )
            if fn in ("sum", "min", "max") and pa.types.is_floating(schema.field(col).type) and not pa.types.is_floating(self.value_type):
                raise GraphError(
                    f"operator {self.uid!r}: aggregation {out!r} over the floating-point column {col!r} "
                    f"cannot be kept as {self.value_type}; pass value_type=pa.float64() to aggregate()"
                )
        ki = schema.get_field_index(self.key)
        if ki < 0:
            raise GraphError(
                f"operator {self.uid!r}: key column {self.key!r} is not in the stream "
                f"(columns: {', '.join(schema.names)}); fix the key_by(...) column name"
            )
        kt = schema.field(ki).type
        self._key_kind = "int" if pa.types.is_integer(kt) else var_key_kind(kt)
        ok = self._key_kind is not None
        for _s, col, fn in self.plan:
            t = schema.field(col).type
            if fn != "count" and not (pa.types.is_integer(t) or pa.types.is_floating(t)):
                ok = False
        self._columnar_schema = ok
        self._schema = schema

    # ------------------------------------------------------------------ processing
    def process(self, batch: pa.RecordBatch) -> pa.RecordBatch | None:
        if not batch.num_rows:
            return None
        self._check_schema(batch.schema)
        backend = self.backend
        if backend.columnar is not None:
            keycol = batch.column(self.key)
            kind = self._key_kind
            if self._columnar_schema and not keycol.null_count and backend.columnar.takes(kind):
                if kind != "int":
                    return self._process_columnar(batch, keycol, None)
                keys = keycol.to_numpy()
                if keys.dtype != np.int64:
                    if keys.dtype == np.uint64 and keys.max() > INT64_MAX:
                        keys = None
                    else:
                        keys = keys.astype(np.int64)
                if keys is not None:
                    return self._process_columnar(batch, keycol, keys)
            backend.migrate_to_dict()
        return self._process_dict(batch)

    def _process_columnar(self, batch: pa.RecordBatch, keycol: pa.Array, keys: np.ndarray | None) -> pa.RecordBatch | None:
        """``keys``: the int64 keys, or None for string/binary keys (``keycol``)."""
        store = self.backend.columnar
        store.maybe_compact()  # slots of key groups given away (live reconfiguration)
        store.refresh_flags()
        n0 = store.n
        slots = store.slots_for(keys) if keys is not None else store.slots_for_var(keycol)
        n1 = store.n
        # inputs per column: (rows with a value or None when all have one, their values)
        inputs: dict[str, tuple] = {}
        work = []
        for state, colname, fn in self.plan:
            c = store.columns[state]
            got = inputs.get(colname)
            if got is None:
                arr = batch.column(colname)
                if arr.null_count:
                    ok = arr.is_valid().to_numpy(zero_copy_only=False)
                    got = (ok, arr.fill_null(0).to_numpy(zero_copy_only=False)[ok])
                else:
                    got = (None, arr.to_numpy(zero_copy_only=False))
                inputs[colname] = got
            ok, vals = got
            s = slots if ok is None else slots[ok]
            v = vals if fn == "count" or vals.dtype == c.dtype else vals.astype(c.dtype)
            if fn == "sum" and c.dtype == np.int64:
                try:
                    self._check_overflow(store, c, s, v)  # before any value changes
                except StateError:
                    for other in store.columns.values():
                        other.all_valid = None  # the batch's new keys stay without values
                    raise
            work.append((c, fn, ok is None, s, v))
        store.touch(slots)
        for c, fn, no_nulls, s, v in work:
            if fn == "count":
                np.add.at(c.values, s, 1)
                valid_rows_all = True  # a count is never null
            else:
                if fn == "sum":
                    np.add.at(c.values, s, v)
                elif fn == "min":
                    (np.fmin if c.dtype.kind == "f" else np.minimum).at(c.values, s, v)
                else:
                    (np.fmax if c.dtype.kind == "f" else np.maximum).at(c.values, s, v)
                valid_rows_all = no_nulls
            # a sum/min/max becomes valid where a non-null value came
            if valid_rows_all and c.all_valid:
                c.valid[n0:n1] = True
            else:
                c.valid[slots if valid_rows_all else s] = True
                c.all_valid = bool(c.all_valid) and bool(c.valid[n0:n1].all())
            if not c.all_present:
                c.present[slots] = True
        if not self.emit_updates:
            return None
        first = first_occurrences(slots)
        uniq = slots[first]
        cols: dict[str, Any] = {"key": keycol.take(pa.array(first))}

        def column(state: str) -> pa.Array:
            c = store.columns[state]
            valid = c.valid[uniq]
            return pa.array(c.values[uniq], mask=None if valid.all() else ~valid, type=_EMIT_TYPE[c.dtype])

        for out, (_col, fn) in self.aggs.items():
            if fn == "mean":
                cols[out] = pc.divide(column(f"{out}.sum"), pc.cast(column(f"{out}.count"), pa.float64()))
            else:
                cols[out] = column(out)
        return pa.RecordBatch.from_pydict(cols)

    def _check_overflow(self, store: ColumnarKeyedState, c: StateColumn, slots: np.ndarray, v: np.ndarray) -> None:
        """Refuse a batch that would make an int64 running sum wrap around (the dict path
        keeps exact Python ints and fails when the capture encodes them). ``c.bound`` bounds
        every |sum|; only when it nears 2**62 are the sums themselves looked at."""
        mag = np.abs(v.astype(np.float64))
        add = float(mag.sum())
        if c.bound is not None and c.bound + add < _SUM_RECHECK:
            c.bound += add
            return
        top = float(np.abs(c.values[: store.n].astype(np.float64)).max(initial=0.0))
        if top + add >= _SUM_RECHECK:
            uniq, inverse = distinct_inverse(slots)
            after = np.abs(c.values[uniq].astype(np.float64)) + np.bincount(inverse, weights=mag, minlength=len(uniq))
            worst = float(after.max(initial=0.0))
            if worst >= _SUM_LIMIT:
                raise StateError(
                    f"operator {self.uid!r}, state {c.name!r}: the running sum of a key would "
                    "exceed the int64 range; aggregate with value_type=pa.float64()"
                )
            top = max(top, worst)
            add = 0.0
        c.bound = top + add

    def _process_dict(self, batch: pa.RecordBatch) -> pa.RecordBatch | None:
        backend = self.backend.dict_backend
        key = self.key
        table = pa.Table.from_batches([batch])
        grouped = table.group_by(key, use_threads=False).aggregate(self.requests)
        keys_arr = grouped.column(key)
        kgs = key_groups(keys_arr, self.max_parallelism)
        order = np.argsort(kgs, kind="stable")
        keys = keys_arr.take(pa.array(order)).to_pylist()  # in key-group order
        sorted_kgs = kgs[order]
        bounds = np.flatnonzero(np.diff(sorted_kgs)) + 1
        starts = np.concatenate(([0], bounds)).tolist()
        ends = np.concatenate((bounds, [len(order)])).tolist()
        # per state: the partial results in key-group order, as numpy (None: they hold a null)
        # and, made when a key group must be merged key by key, as Python values
        arrays = []
        for state, col, fn in self.plan:
            part = grouped.column(f"{col}_{fn}")
            arrays.append(None if part.null_count else part.to_numpy().astype(self.dtypes[state], copy=False)[order])
        lists: list = [None] * len(self.plan)
        new_values = [[None] * len(keys) for _ in self.plan] if self.emit_updates else None
        for s, e in zip(starts, ends):
            kg = int(sorted_kgs[s])
            ks = keys[s:e]
            for p, (state, col, fn) in enumerate(self.plan):
                if arrays[p] is not None:
                    folded = backend.fold_many(state, kg, ks, arrays[p][s:e], fn)
                    if folded is not None:
                        if new_values is not None:
                            new_values[p][s:e] = folded.tolist()
                        continue
                if lists[p] is None:
                    lists[p] = self._partials(grouped.column(f"{col}_{fn}"), state, order)
                merge = _MERGE[fn]
                merged = [merge(o, v) for o, v in zip(backend.get_many(state, kg, ks), lists[p][s:e])]
                backend.put_many(state, kg, ks, merged)
                if new_values is not None:
                    new_values[p][s:e] = merged
        if new_values is not None:  # back to the order of the grouped keys
            inverse = np.empty(len(order), np.int64)
            inverse[order] = np.arange(len(order))
            at = inverse.tolist()
            new_values = [[vals[i] for i in at] for vals in new_values]
        if not self.emit_updates:
            return None
        values = {state: vals for (state, _c, _f), vals in zip(self.plan, new_values)}  # type: ignore[arg-type]
        cols: dict[str, Any] = {"key": keys_arr.combine_chunks() if isinstance(keys_arr, pa.ChunkedArray) else keys_arr}
        for out, (_col, fn) in self.aggs.items():
            if fn == "mean":
                sums = pa.array(values[f"{out}.sum"], pa.float64())
                counts = pa.array(values[f"{out}.count"], pa.int64())
                cols[out] = pc.divide(sums, pc.cast(counts, pa.float64()))
            else:
                cols[out] = pa.array(values[out], _EMIT_TYPE[self.dtypes[out]])
        return pa.RecordBatch.from_pydict(cols)

    def _partials(self, part: Any, state: str, order: np.ndarray) -> list:
        """Partial results of one state in key-group order, as Python values (floats for a
        floating-point state)."""
        values = part.take(pa.array(order)).to_pylist()
        if self.dtypes[state].kind == "f":
            values = [None if x is None else float(x) for x in values]
        return values


def _merge_sum(o: Any, p: Any) -> Any:
    if o is None:
        return p
    return o if p is None else o + p


def _merge_min(o: Any, p: Any) -> Any:
    # NaN is ignored unless both are NaN (Arrow's min, numpy's fmin)
    if o is None or o != o:
        return o if p is None else p
    if p is None or p != p:
        return o
    return p if p < o else o


def _merge_max(o: Any, p: Any) -> Any:
    if o is None or o != o:
        return o if p is None else p
    if p is None or p != p:
        return o
    return p if p > o else o


_MERGE = {"sum": _merge_sum, "count": _merge_sum, "min": _merge_min, "max": _merge_max}
