"""Captured deltas: what the synchronous part of a snapshot takes, and the asynchronous part
encodes to Arrow (``to_table()``, in the uploader thread or the writer process).

Every delta has ``to_table()`` and ``complete`` (the table holds every live key of its key
group, so storage may write it as a new base without reading the chain back); see
:class:`abs.state.protocol.Delta`.

* :class:`PendingDelta`: a dict key group of immutable values, captured by reference;
* :class:`PickledDelta`: the changed entries of an untyped state, frozen by one pickle;
* :class:`ColumnDelta`: a columnar key group of the dict backend (:mod:`abs.columns`);
* :class:`FrozenSlots` / :class:`SlotsDelta`: the columnar aggregate store's changed slots
  (:mod:`abs.state.columnar`).
"""
from __future__ import annotations

import itertools
import pickle
import threading
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from abs.columns import Captured, KeyOrders, SameKeys, _text_array
from abs.errors import StateError

from .encoding import (ENCODING_PICKLE, MISSING, column_table, delta_table, encode_keys, encode_pairs, pickled_values,
                       split_deletes, values_metadata, values_table)
from .varkeys import Gathered, VarKeys

if TYPE_CHECKING:
    from .protocol import KeyedBackend
    from .slots import StateSlot

__all__ = ["PendingDelta", "ColumnDelta", "PickledDelta", "FrozenSlots", "SlotsDelta"]


# ----------------------------------------------------------------------------- dict backend


class PendingDelta:
    """A delta captured by reference (see :meth:`KeyedStateBackend.capture` with ``lazy``),
    encoded to Arrow by :meth:`to_table` in the asynchronous part.

    The synchronous part costs at most about one C-level dict copy per changed key group:
    the changed-key sets are frozen objects already (capture swaps in fresh ones), and the
    values are frozen either by looking up the changed keys now (when they are few) or by
    copying the key group's dict (``dict.copy`` runs at C speed, cheaper than a Python
    loop once more than about a tenth of the key group changed).
    """

    __slots__ = ("_uid", "_slot", "_kg", "_key_sets", "_frozen", "_keys", "_values", "_deletes", "complete")

    def __init__(self, backend: KeyedBackend, slot: StateSlot, kg: int, key_sets: list, d: dict,
                 deletes: bool = True) -> None:
        self._uid = backend.operator_uid
        self._slot = slot
        self._kg = kg
        self._key_sets = key_sets
        self._deletes = deletes  # False: every changed key is still in the dict
        self.complete = False  # set by to_table/image: the table holds every live key of the key group
        if sum(len(ks) for ks in key_sets) * 10 < len(d):
            self._keys = list(key_sets[0]) if len(key_sets) == 1 else list(set().union(*key_sets))
            get = d.get
            self._values: list | None = list(map(get, self._keys, itertools.repeat(MISSING)))
            self._frozen: dict | None = None
        else:
            self._keys = None
            self._values = None
            self._frozen = d.copy()

    def to_table(self) -> pa.Table:
        keys, values = self._keys, self._values
        deletes = None if self._deletes else False
        if keys is None:
            sets = self._key_sets
            changed = sets[0] if len(sets) == 1 else set().union(*sets)
            frozen = self._frozen
            if frozen and len(changed) * _IMAGE_DENOMINATOR >= len(frozen) * _IMAGE_NUMERATOR:
                # most of the key group changed: its full image (the frozen dict, deletes
                # already applied) costs a little more than the delta, keys and values come in
                # one sequential C-level pass each with no per-key lookup, and the store writes
                # it as the new base without ever reading the old chain back
                return self.image()  # type: ignore[return-value]  # frozen is non-empty
            keys = list(changed)
            get = frozen.get
            values = list(map(get, keys, itertools.repeat(MISSING)))
        return encode_pairs(self._uid, self._slot, self._kg, keys, values, with_op=True, deletes=deletes)

    def image(self) -> pa.Table | None:
        """The key group's full live state at the capture as upserts (sets ``complete``), or
        ``None`` when the capture froze only the changed keys (or the key group is empty).
        The store calls it instead of reading the previous chain back when its policy
        compacts the chain."""
        frozen = self._frozen
        if not frozen:
            return None
        self.complete = True
        return encode_pairs(self._uid, self._slot, self._kg, list(frozen), list(frozen.values()),
                            with_op=True, deletes=False)


# A lazily captured key group is written as its full image when at least 3/4 of its live keys
# changed: the file is at most 4/3 of the delta's, and the chain restarts at length 1.
_IMAGE_NUMERATOR, _IMAGE_DENOMINATOR = 3, 4

VALUES_IMAGE_SHARE = 0.3
"""A columnar key group's capture of every row in which at least this share of the keys changed
(but less than :data:`abs.columns._IMAGE_SHARE`, from which it is the full image anyway) is
written as a values image when its keys are those of its base (:meth:`ColumnDelta.as_image`):
its values alone (8 bytes a row for int64) instead of the changed keys, values and ops (~17),
and the chain stays a base and one values image instead of growing deltas that a compaction
rewrites as a new base every second or third checkpoint. The ABS paper's workload (1 M int64
keys, 64 key groups per writer, a checkpoint every second) captures 25-80 % of the keys per
checkpoint on a loaded machine; a writer's CPU per checkpoint there (mean of 18) went from 39-41
to 29-32 ms at 50-65 % (1.2-1.3 -> 0.98 MB written) and from 35-45 to 30-40 ms at 35 %; below
VALUES_IMAGE_SHARE (25 %: a delta of ~0.4 of the values image's bytes) nothing changes."""


class ColumnDelta:
    """The captured change of a columnar key group (see :mod:`abs.columns`): copies taken in
    the synchronous part, encoded to Arrow by :meth:`to_table` in the asynchronous part.
    ``complete``: the table is the key group's full image. Self-contained and picklable, so
    that another process can encode and write it (see :mod:`abs.runtime.writer`).

    An untyped state's column (``arrow_type`` None) captured references to its values, which
    may be mutable: they are frozen here, still in the synchronous part, by one
    ``pickle.dumps`` of their list (a C-level deep copy, as :class:`PickledDelta` does), and
    :meth:`to_table` pickles each value on its own from that copy."""

    __slots__ = ("_captured", "_arrow_type", "_kind", "_blob", "complete", "_sorted")

    def __init__(self, captured: Captured, arrow_type: pa.DataType | None, kind: str, blob: bytes | None = None) -> None:
        if arrow_type is None and blob is None:
            blob = pickle.dumps(captured.values, pickle.HIGHEST_PROTOCOL)
            captured = replace(captured, values=None)
        self._captured = captured
        self._arrow_type = arrow_type
        self._kind = kind
        self._blob = blob
        self.complete = captured.complete
        self._sorted: tuple | None = None  # (orders, slot, order, sorted keys) of the last _sort

    def _sort(self, orders: KeyOrders, slot: Any) -> tuple[np.ndarray, np.ndarray]:
        """``orders.sort(slot, keys)`` of the captured int64 keys, asked of ``orders`` once per
        delta: a write needs it up to three times (:meth:`image_keys` before and after,
        :meth:`to_table`), and each ask compares the whole key array."""
        memo = self._sorted
        if memo is None or memo[0] is not orders or memo[1] != slot:
            order, ordered = orders.sort(slot, self._rows().keys)
            memo = self._sorted = (orders, slot, order, ordered)
        return memo[2], memo[3]

    def _rows(self) -> Captured:
        """The captured rows (a subclass may cut them out of a larger capture on first use)."""
        return self._captured

    def __getstate__(self) -> tuple:
        return self._rows(), self._arrow_type, self._kind, self._blob

    def __setstate__(self, state: tuple) -> None:
        self.__init__(*state)  # type: ignore[misc]

    def _values(self) -> np.ndarray | list:
        return self._rows().values if self._blob is None else pickle.loads(self._blob)

    def to_table(self, orders: KeyOrders | None = None, slot: Any = None) -> pa.Table:
        """The delta as a table. ``orders``: when the rows are the key group's full image
        (integer keys, no deletes), they come out sorted by key in the order ``orders``
        keeps for ``slot``, and the store's sort finds them sorted."""
        c = self._rows()
        keys, values, nulls = c.delta_rows(self._values())
        if orders is not None and c.all_rows and c.changed is None and not c.deleted:
            keys, values, nulls = _sorted_rows(self, orders, slot, keys, values, nulls)
        return column_table(self._arrow_type, self._kind, keys, values, nulls, c.deleted)

    @property
    def num_rows(self) -> int:
        """The rows of :meth:`to_table` (without building it)."""
        c = self._rows()
        return (len(c.keys) if c.changed is None else len(c.changed)) + len(c.deleted)

    @property
    def typed_image(self) -> bool:
        """Whether :meth:`to_table` gives the key group's full image over int64 keys of a typed
        state (every row, no delete): :meth:`sorted_image` then has it in columns."""
        c = self._rows()
        return (self._arrow_type is not None and c.all_rows and c.changed is None and not c.deleted
                and isinstance(c.keys, np.ndarray) and len(c.keys) >= 2)

    def sorted_image(self, orders: KeyOrders, slot: Any) -> tuple[np.ndarray, pa.Table]:
        """A :attr:`typed_image`'s keys in ascending order (the array ``orders`` keeps for
        ``slot``, see :meth:`image_keys`) and its other columns in that order (the ``value``
        column, with the delta's schema metadata), without building the delta's table: a
        values image needs no more (:func:`storage.values_images.values_image_over`)."""
        ordered, values, nulls = self.sorted_values(orders, slot)
        return ordered, self.values_table(values, nulls)

    def values_table(self, values: np.ndarray, nulls: np.ndarray | None) -> pa.Table:
        """:func:`values_table` of rows of this delta's state (a ``value`` column of its type)."""
        return values_table(self._arrow_type, self._kind, values, nulls)

    def sorted_values(self, orders: KeyOrders, slot: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """:meth:`sorted_image` as arrays: the keys in ascending order, the values and the null
        mask (None: no null) in that order; the values as the column holds them (their dtype
        may differ from :attr:`value_type`, which a table of them casts to)."""
        if not self.typed_image:
            raise ValueError("sorted_image: the delta is not a full image over int64 keys of a typed state (typed_image)")
        c = self._rows()
        order, ordered = self._sort(orders, slot)
        return ordered, c.values[order], None if c.nulls is None else c.nulls[order]

    @property
    def value_type(self) -> pa.DataType | None:
        """The Arrow type of the state's values (None: pickled objects)."""
        return self._arrow_type

    def values_metadata(self) -> dict:
        """The schema metadata of the tables of this delta's values (:func:`values_table`)."""
        return values_metadata(self._kind)

    def full_list_keys(self) -> list | pa.Array | None:
        """The keys of the delta when it is a full image (no deletes) whose keys are a list
        (not int64), or the Arrow text keys of a probed key group (:mod:`abs.state.restored`):
        those :class:`KeyOrders` sorts and remembers by key group
        (:meth:`KeyOrders.sort_text`). Else ``None``."""
        c = self._rows()
        if c.all_rows and c.changed is None and not c.deleted and isinstance(c.keys, (list, pa.Array)):
            return c.keys
        return None

    def with_same_keys(self) -> ColumnDelta:
        """This delta with :class:`SameKeys` for its :meth:`full_list_keys`, to send to a writer
        process that received those very keys in the last full image of the key group."""
        c = self._rows()
        return ColumnDelta(replace(c, keys=SameKeys(len(c.keys))), self._arrow_type, self._kind, self._blob)

    def with_arrow_keys(self) -> ColumnDelta:
        """This delta with its :meth:`full_list_keys` as an Arrow string or binary array (the
        one :meth:`KeyOrders.sort_text` makes of them), for a writer process: it then never
        holds the keys as Python objects. Itself when they are neither all ``str`` nor all
        ``bytes`` (or too many for one array)."""
        c = self._rows()
        arr = _text_array(c.keys)
        if not isinstance(arr, pa.Array):  # None, or chunked (over 2 GB of keys): sent as they are
            return self
        return ColumnDelta(replace(c, keys=arr), self._arrow_type, self._kind, self._blob)

    def receive_keys(self, orders: KeyOrders, slot: Any) -> None:
        """In the writer process, at receipt (before any write can fail): sort and remember the
        :meth:`full_list_keys` of the delta for ``slot`` (or check that ``orders`` holds those
        :class:`SameKeys` stands for), then hold :class:`SameKeys` in their place, so that the
        writer's memory matches what the worker remembers having sent."""
        c = self._rows()
        if not (c.all_rows and c.changed is None and not c.deleted and isinstance(c.keys, (list, SameKeys, pa.Array))):
            return
        _text_keys(orders, slot, c.keys)
        if not isinstance(c.keys, SameKeys):
            self._captured = replace(c, keys=SameKeys(len(c.keys)))

    def image_keys(self, orders: KeyOrders, slot: Any) -> np.ndarray | None:
        """When the capture copied the key group's every row (its full image, or the image
        a compaction writes as a new base, :meth:`image`), two or more int64 keys and no
        delete: its keys in ascending order, as the array ``orders`` keeps for ``slot``, which
        stays the very same object while the key group's keys do not change (an identity check
        then tells that they did not). Else ``None``."""
        c = self._rows()
        if not (c.all_rows and not c.deleted and isinstance(c.keys, np.ndarray) and len(c.keys) >= 2):
            return None
        return self._sort(orders, slot)[1]

    def as_image(self) -> ColumnDelta | None:
        """This delta as its key group's full image (``complete``, every row), when the
        capture copied every row of int64 keys (:data:`abs.columns._COPY_ALL_SHARE`), at least
        :data:`VALUES_IMAGE_SHARE` of them changed and none was deleted; else ``None``. The
        writer takes it when its keys are those of the base it last wrote (a values image over
        that base, see :func:`abs.runtime.writer.write_jobs`)."""
        c = self._rows()
        if self.complete or not c.all_rows or c.changed is None or c.deleted or not isinstance(c.keys, np.ndarray) \
                or len(c.changed) < VALUES_IMAGE_SHARE * len(c.keys) or len(c.keys) < 2:
            return None
        image = ColumnDelta(replace(c, changed=None, complete=True), self._arrow_type, self._kind, self._blob)
        image._sorted = self._sorted
        return image

    def base(self, orders: KeyOrders, slot: Any) -> pa.Table | None:
        """The delta as a base (:attr:`storage.store_write.KeyGroupWrite.base`): when it is its
        key group's full image (every row, no delete) whose keys come out in ascending order
        (int64 keys, ``str`` or ``bytes`` keys sorted as :meth:`to_table` sorts them, the
        columnar aggregate's keys, cut sorted by key group), its rows in that order without an
        ``op`` column; else ``None`` (the write then folds :meth:`to_table`). A key group's
        keys are unique (its column's index, or the aggregate's, holds each once); their order
        is checked where the file is encoded (:func:`storage.format.prepare_table` sorts what
        is not sorted)."""
        c = self._rows()
        if not (c.all_rows and c.changed is None and not c.deleted and len(c.keys)):
            return None
        if not isinstance(c.keys, (np.ndarray, list, SameKeys, VarKeys)):
            return None  # e.g. Arrow keys not received yet (receive_keys sorts them)
        keys, values, nulls = _sorted_rows(self, orders, slot, c.keys, self._values(), c.nulls)
        if not isinstance(keys, (np.ndarray, pa.Array, VarKeys)):  # VarKeys: the aggregate's, cut sorted
            return None  # keys Arrow does not order (mixed types): stored in the writer's order
        return column_table(self._arrow_type, self._kind, keys, values, nulls, [], with_op=False)

    def image(self, orders: KeyOrders | None = None, slot: Any = None) -> pa.Table | None:
        """The key group's full live state at the capture, when the capture copied it;
        ``orders``, ``slot``: as for :meth:`to_table`."""
        c = self._rows()
        if not c.all_rows or not len(c.keys):
            return None
        keys, values, nulls = c.keys, self._values(), c.nulls
        if orders is not None:
            keys, values, nulls = _sorted_rows(self, orders, slot, keys, values, nulls)
        return column_table(self._arrow_type, self._kind, keys, values, nulls, [])


def _sorted_rows(delta: ColumnDelta, orders: KeyOrders, slot: Any, keys: Any, values: Any,
                 nulls: np.ndarray | None) -> tuple:
    """A full image's rows (``delta``'s captured keys) in key order, when its keys are an int64
    array, or ``str`` or ``bytes`` keys (then an Arrow array; :class:`SameKeys`: those of the
    full image ``orders`` last saw for ``slot``); else unchanged."""
    if isinstance(keys, (list, SameKeys)):
        order, ordered = _text_keys(orders, slot, keys)
        if order is None:
            return ordered, values, nulls
    elif not isinstance(keys, np.ndarray) or len(keys) < 2:
        return keys, values, nulls
    else:
        order, ordered = delta._sort(orders, slot)
    values = values[order] if isinstance(values, np.ndarray) else [values[i] for i in order.tolist()]
    return ordered, values, None if nulls is None else nulls[order]


def _text_keys(orders: KeyOrders, slot: Any, keys: list | SameKeys) -> tuple[np.ndarray | None, Any]:
    """:meth:`KeyOrders.sort_text` of a full image's list of keys, or what it gave for the
    keys :class:`SameKeys` stands for."""
    if not isinstance(keys, SameKeys):
        return orders.sort_text(slot, keys)
    known = orders.text(slot)
    if known is None or len(known[1]) != len(keys):
        raise StateError(
            f"{' / '.join(map(str, slot)) if isinstance(slot, tuple) else slot} (operator / state / key group): "
            "the worker sent a full image standing for the keys it sent before, and this writer does not "
            "hold them; the checkpoint is declined and the worker sends every key again"
        )
    return known[0], known[1]


class PickledDelta:
    """The changed entries of an untyped state (values pickled one by one into a binary
    column), frozen in the synchronous part by a single ``pickle.dumps`` of the list of their
    values: one C-level call that deep-copies whatever the values are (lists and dicts a user
    goes on mutating included), instead of a Python-level ``dumps`` per value while the task
    waits. :meth:`to_table` unpickles the list and pickles each value on its own in the
    asynchronous part, giving the same bytes as pickling the live values would have.
    Self-contained and picklable, so the worker's writer process can do that part."""

    __slots__ = ("_kind", "_keys", "_blob", "_ops", "complete")

    def __init__(self, kind: str, keys: list, values: list) -> None:
        self._kind = kind
        self._keys = keys
        values, self._ops = split_deletes(values)
        self._blob = pickle.dumps(values, pickle.HIGHEST_PROTOCOL)
        self.complete = False

    def __getstate__(self) -> tuple:
        return self._kind, self._keys, self._blob, self._ops

    def __setstate__(self, state: tuple) -> None:
        self._kind, self._keys, self._blob, self._ops = state
        self.complete = False

    def to_table(self) -> pa.Table:
        key_arr, key_enc = encode_keys(self._keys)
        value_arr = pickled_values(pickle.loads(self._blob), self._ops)
        return delta_table(self._kind, key_arr, key_enc, value_arr, ENCODING_PICKLE, self._ops, with_op=True)

    def image(self) -> None:
        """No full image: the capture froze only the changed entries."""
        return None


# ----------------------------------------------------------------------------- columnar store


class FrozenSlots:
    """Copies, taken at capture, of some slots' key groups, keys and per-state values (of
    every slot: views of the keys and key groups, which never change), cut into per-key-group
    rows on demand (once; thread-safe), a chunk of key groups at a time (:meth:`chunk`).

    The rows of each key group are numpy views of arrays of their own (the copies, sorted by
    key group), never slices of one Arrow array: pyarrow pickles a slice with its parent's
    whole buffers, so the per-key-group tables the store cut from one array each carried the
    whole state to the writer process (a checkpoint of 1M keys in 128 key groups sent
    128 x 17 MB through its pipe, seconds of copying where the process path took 0.2 s)."""

    def __init__(self, store: Any, slots: np.ndarray) -> None:
        # store: the ColumnarKeyedState (not imported: it imports this module)
        self.uid = store.operator_uid
        n = store.n
        self._by_kg: Any = None  # every slot taken: the store's kept order by key group (see _split)
        if len(slots) == n:  # every slot (slots is then 0..n-1): plain copies beat gathers
            sel: Any = slice(0, n)
            self._groups: list[int] | None = np.flatnonzero(store.kg_counts).tolist()
            self._complete: Any = True
            # views, not copies: a slot's key and key group never change once written (the
            # store only appends slots, and a grown array starts as a copy of the old one)
            self.kgs = store.kg[:n]
            self.keys = store.key_rows[:n]
            self._by_kg = store.order_by_key_group
        else:
            sel = slots
            self._groups = None
            # key groups whose every slot changed: their deltas are full images (no deletes
            # exist in this store), which storage writes as new bases without reading the chain
            counts = np.bincount(store.kg[slots], minlength=len(store.kg_counts))
            self._complete = (counts == store.kg_counts) & (counts > 0)
            self.kgs = store.kg[sel].copy()
            self.keys = store.key_rows[sel].copy()
        # (None: every slot of the store is valid / present, nothing to copy)
        self.cols = [(c, c.values[sel].copy(), None if c.all_valid else c.valid[sel].copy(),
                      None if c.all_present else c.present[sel].copy()) for c in store.columns.values()]
        self.arrow_types = {c.name: c.arrow_type for c in store.columns.values()}
        self._lock = threading.Lock()
        self._rows: dict[str, dict[int, Captured]] | None = None  # cut so far
        self._layout: tuple | None = None  # (order, keys in that order, chunks, chunk of each key group)
        self._cut_chunks: set[int] = set()

    def complete(self, kg: int) -> bool:
        """True when the delta of ``kg`` holds every key the key group has."""
        return self._complete is True or bool(self._complete[kg])

    def key_groups(self) -> list[int]:
        """Key groups with at least one slot, ascending."""
        if self._groups is None:
            seen = np.zeros(int(self.kgs.max()) + 1 if len(self.kgs) else 0, bool)
            seen[self.kgs] = True
            self._groups = np.flatnonzero(seen).tolist()
        return self._groups

    def rows(self, name: str, kg: int) -> Captured:
        """The rows of key group ``kg`` in state ``name`` (none when its slots hold no entry of
        that state); cuts the chunk of key groups ``kg`` is in (:meth:`chunk`), once."""
        with self._lock:
            self._cut_chunk(self._plan()[3].get(kg))
            got = self._rows[name].get(kg)  # type: ignore[index]
        if got is None:
            dtype = _numpy_dtype(self.arrow_types[name])
            got = Captured(keys=np.zeros(0, np.int64), values=np.zeros(0, dtype), nulls=None, changed=None,
                           deleted=[], all_rows=self.complete(kg), complete=self.complete(kg))
        return got

    def chunk(self, kg: int) -> int | None:
        """The chunk of key groups ``kg`` is cut with: consecutive key groups of about
        :data:`CHUNK_ROWS` (:data:`INT_CHUNK_ROWS`) rows or more (at most :data:`MAX_CHUNKS`
        chunks), cut (keys gathered,
        values copied) when one of their rows is first asked for, so that a writer can encode
        one chunk while the next is cut (see ``abs.runtime.writer.SnapshotWriter.write``).
        None: ``kg`` has no row."""
        with self._lock:
            return self._plan()[3].get(kg)

    def split(self) -> dict[str, dict[int, Captured]]:
        """State name -> key group -> its rows, every chunk cut."""
        with self._lock:
            chunks = self._plan()[2]
            for i in range(len(chunks)):
                self._cut_chunk(i)
            return self._rows  # type: ignore[return-value]

    def encode(self) -> dict[str, dict[int, pa.Table]]:
        """State name -> key group -> delta table (key groups with an entry of the state)."""
        return {name: {kg: _rows_table(self.arrow_types[name], rows) for kg, rows in by_kg.items()}
                for name, by_kg in self.split().items()}

    def _plan(self) -> tuple:
        """(order, keys in that order (or what cuts them), chunks ``[(start, end, bounds)]``,
        key group -> chunk), made once (under the lock): the slots by key group, and the
        values narrowed to their Arrow types (a value that does not fit raises here)."""
        if self._layout is None:
            if not len(self.kgs):
                order, keys, bounds = np.zeros(0, np.int64), self.keys, []
            elif self._by_kg is not None:
                order, keys, bounds = self._by_kg(len(self.kgs))
            else:
                order = np.argsort(self.kgs, kind="stable")
                keys = self.keys[order] if isinstance(self.keys, np.ndarray) else Gathered(self.keys, order)
                bounds = group_bounds(self.kgs[order])
            # valid None: every value (of a slot present in the state) is valid, no null mask
            self.cols = [(col, self._narrow(col, values, valid),
                          None if valid is None or valid[slice(None) if present is None else present].all() else valid,
                          present) for col, values, valid, present in self.cols]
            chunks = _chunks(bounds, len(order), CHUNK_ROWS if isinstance(keys, Gathered) else INT_CHUNK_ROWS)
            chunk_of = {g: i for i, (_, _, part) in enumerate(chunks) for _, _, g in part}
            self._rows = {c.name: {} for c, *_ in self.cols}
            self._layout = (order, keys, chunks, chunk_of)
        return self._layout

    def _cut_chunk(self, i: int | None) -> None:
        """Cut chunk ``i``'s rows of every state (under the lock; once)."""
        if i is None or i in self._cut_chunks:
            return
        order, keys, chunks, _ = self._layout  # type: ignore[misc]
        start, end, bounds = chunks[i]
        local = [(s - start, e - start, g) for s, e, g in bounds]
        if isinstance(keys, Gathered):  # string/binary keys: each key group's sorted, as storage writes them
            sub, chunk_keys = keys.sorted_slice(start, end, local)
        else:
            sub, chunk_keys = order[start:end], None
        for col, values, valid, present in self.cols:
            nulls = None if valid is None else ~valid
            if present is None or present.all():
                if chunk_keys is None:
                    chunk_keys = keys[start:end]
                cut = self._cut(chunk_keys, local, values[sub], None if nulls is None else nulls[sub])
            else:
                sel = sub[present[sub]]
                cut = self._cut(self.keys[sel], group_bounds(self.kgs[sel]), values[sel],
                                None if nulls is None else nulls[sel])
            self._rows[col.name].update(cut)  # type: ignore[index]
        self._cut_chunks.add(i)
        if len(self._cut_chunks) == len(chunks):  # every row cut: free the copies
            self.cols = [(c, None, None, None) for c, *_ in self.cols]
            self._layout = (None, None, chunks, self._layout[3])  # type: ignore[index]

    def _narrow(self, col: Any, values: np.ndarray, valid: np.ndarray | None) -> np.ndarray:
        """``values`` (the accumulators' dtype) in the numpy dtype of the state's Arrow type;
        a value that does not fit raises :class:`StateError`."""
        dtype = _numpy_dtype(col.arrow_type)
        if dtype == values.dtype:
            return values
        if dtype.kind in "iu" and len(values):
            live = values if valid is None else values[valid]
            info = np.iinfo(dtype)
            bad = np.flatnonzero((live < info.min) | (live > info.max))
            if bad.size:
                raise StateError(
                    f"operator {self.uid!r}, state {col.name!r}: a value does not fit the declared "
                    f"Arrow type {col.arrow_type} ({live[bad[0]]} is out of its range); aggregate with a "
                    "wider value_type"
                )
        return values.astype(dtype)

    def _cut(self, keys: Any, bounds: list[tuple[int, int, int]], vals: np.ndarray,
             nulls: np.ndarray | None) -> dict[int, Captured]:
        out = {}
        for s, e, g in bounds:
            whole = self.complete(g)
            out[g] = Captured(keys=keys[s:e], values=vals[s:e], nulls=None if nulls is None else nulls[s:e],
                              changed=None, deleted=[], all_rows=whole, complete=whole)
        return out


CHUNK_ROWS = 1 << 19
"""A capture of the columnar store with string or binary keys is cut in chunks of key groups
of at least this many rows (:meth:`FrozenSlots.chunk`; their cut, the keys sorted and
gathered, costs the worker about what their encoding costs the writer) ..."""
INT_CHUNK_ROWS = 1 << 20
"""... with integer keys, of at least this many (a cheap cut: the writer, which syncs every
chunk's packed file to disk, ~20-40 ms each here, is the longer part) ..."""
MAX_CHUNKS = 4
"""... and at most this many (larger chunks then)."""


def _chunks(bounds: list[tuple[int, int, int]], rows: int, least: int) -> list[tuple[int, int, list]]:
    """``bounds`` (key group runs, in order) grouped into consecutive chunks ``(start, end,
    runs)`` of at least ``max(least, rows / MAX_CHUNKS)`` rows (the last may hold fewer)."""
    size = max(least, -(-rows // MAX_CHUNKS))
    chunks: list[tuple[int, int, list]] = []
    part: list = []
    for run in bounds:
        part.append(run)
        if run[1] - part[0][0] >= size:
            chunks.append((part[0][0], run[1], part))
            part = []
    if part:
        chunks.append((part[0][0], part[-1][1], part))
    return chunks


def group_bounds(kgs: np.ndarray) -> list[tuple[int, int, int]]:
    """``(start, end, key group)`` of each run of equal values in ``kgs`` (sorted)."""
    m = len(kgs)
    if not m:
        return []
    cuts = np.flatnonzero(kgs[1:] != kgs[:-1]) + 1
    starts = [0] + cuts.tolist()
    ends = cuts.tolist() + [m]
    return list(zip(starts, ends, kgs[starts].tolist()))


def _numpy_dtype(arrow_type: pa.DataType) -> np.dtype:
    return np.dtype(arrow_type.to_pandas_dtype())


def _rows_table(arrow_type: pa.DataType, rows: Captured) -> pa.Table:
    return column_table(arrow_type, "value", rows.keys, rows.values, rows.nulls, [])


class SlotsDelta(ColumnDelta):
    """One key group's delta of one state of the columnar store: a :class:`ColumnDelta`
    whose rows are cut out of the :class:`FrozenSlots` copies when first needed, in the
    asynchronous part (encoded in the uploader thread, or pickled for the writer process,
    which then receives a plain :class:`ColumnDelta` of this key group's rows alone and
    encodes it with the sort orders and values images it keeps)."""

    __slots__ = ("_frozen", "_name", "_kg")

    def __init__(self, frozen: FrozenSlots, name: str, kg: int) -> None:
        # not ColumnDelta.__init__, which needs the rows: the same fields, the rows left for later
        self._frozen = frozen
        self._name = name
        self._kg = kg
        self._captured = None  # type: ignore[assignment]  # cut on first use (_rows)
        self._arrow_type = frozen.arrow_types[name]
        self._kind = "value"
        self._blob = None
        self.complete = frozen.complete(kg)
        self._sorted = None

    def _rows(self) -> Captured:
        if self._captured is None:
            self._captured = self._frozen.rows(self._name, self._kg)
        return self._captured

    def __reduce__(self) -> tuple:
        return ColumnDelta, (self._rows(), self._arrow_type, self._kind)

    def chunk(self) -> tuple[int, int | None]:
        """Which chunk of which capture its rows are cut with (:meth:`FrozenSlots.chunk`)."""
        return id(self._frozen), self._frozen.chunk(self._kg)


# Sort-based set operations: numpy 2.x's np.unique takes a slow hashing path for integers
# (about 20x slower than a sort for 10,000 int64s).

