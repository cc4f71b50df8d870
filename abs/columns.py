"""Columnar key groups of a value state: keys and values unboxed in arrays, or the values
kept as objects in a list for an untyped state.

A ``ValueState`` declared with a fixed-width numeric Arrow type (``int8`` .. ``int64``,
``uint8`` .. ``uint64``, ``float64``), or declared without a type (values pickled), keeps
each key group as a :class:`Column` instead of a ``dict``:

* ``index``: ``dict`` key -> slot; ``keys``: the key of each slot, an ``array('q')`` while every
  key is an ``int`` in int64 range, a ``list`` from the first other key on; ``values``: an
  ``array`` of the state's C type, or a ``list`` of the objects themselves for an untyped
  state (typecode :data:`OBJECTS`; ``None`` is then a value like any other); ``stamps``:
  ``array('q')``, the backend *epoch* of each slot's last write; ``nulls``: slots holding
  ``None``; ``deleted``: key -> epoch of the keys deleted since the last confirmed capture.
* Slots are dense: a delete moves the last slot into the hole.
* Dirty tracking is the stamp. The backend's epoch advances at every capture, so the keys
  changed since the last *confirmed* capture are the slots stamped after that capture's
  epoch: overlapping captures and aborted ones need no bookkeeping, and a write costs one
  array store instead of a ``set.add``.

The synchronous part of a snapshot (:meth:`Column.capture`) is a comparison over the stamps
and a copy of the changed keys and values with numpy; the Arrow encoding later works on those
copies without touching a Python object (integer keys), so the asynchronous part runs almost
entirely outside the GIL. For an untyped state the copy is a gather of references, which
``abs.state.ColumnDelta`` freezes with one pickle. A write of a value the C type cannot hold
raises ``TypeError`` or ``OverflowError`` with nothing changed. Inserting a key costs more
than in a dict (three appends and a slot, ~0.4 us more); updates cost about the same.

On the hot path, reading a value builds an int object from the array and a write stores
into two arrays; :class:`abs.state.ColumnValueStateHandle` writes the slot its read just
found, so a read-modify-write through the handle costs about what it does with a dict
(the ``process`` operator alone, 100k keys: within ~3 % per record, in the noise).

This module knows nothing of Arrow schemas or the snapshot format: :mod:`abs.state` builds
tables from a :class:`Captured`.
"""
from __future__ import annotations

import itertools
import threading
from array import array
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from abscore.native import NATIVE

__all__ = ["Captured", "Column", "KeyOrders", "OBJECTS", "SameKeys", "typecode_of"]

OBJECTS = "O"
"""Typecode of a column of Python objects (an untyped ``ValueState``): its values are a list."""

_TYPECODES = {
    pa.int8(): "b", pa.int16(): "h", pa.int32(): "i", pa.int64(): "q",
    pa.uint8(): "B", pa.uint16(): "H", pa.uint32(): "I", pa.uint64(): "Q",
    pa.float64(): "d",
}
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1

# A capture copies the whole key group (not just the changed slots) once this share of it
# changed: the copy costs a few ns per slot, and the store can then compact the chain from
# memory (``image``). From ``_IMAGE_SHARE`` on, the full image *is* the delta.
_COPY_ALL_SHARE = 0.1
_IMAGE_SHARE = 0.75


# Column.fold: the columns it folds into, its numpy operations per aggregation and value kind
# (floats: NaN is ignored unless both are NaN, like the key-by-key merge), and the bound past
# which an int64 sum or count goes key by key
_FOLD_DTYPES = (np.dtype(np.int64), np.dtype(np.float64))
_FOLDS = {"sum": {"i": np.add, "f": np.add}, "count": {"i": np.add, "f": np.add},
          "min": {"i": np.minimum, "f": np.fmin}, "max": {"i": np.maximum, "f": np.fmax}}
_FOLD_INT_LIMIT = 2.0**62


# Slot numbers as shared int objects: every key group's ``index`` maps its keys to the same
# objects 0, 1, 2... made once, side by side in memory, instead of an int object per key (ints
# from 256 on are not cached by Python). A lookup touches (increments) the int it returns:
# these stay in cache however many keys there are, and each key costs 32 bytes less.
_SLOTS: list[int] = list(range(1024))
_SLOTS_GROW = threading.Lock()


def _slots(n: int) -> list[int]:
    """The shared slot ints, at least ``n`` of them (``_SLOTS[i] == i``)."""
    if len(_SLOTS) < n:
        with _SLOTS_GROW:
            have = len(_SLOTS)
            if have < n:
                _SLOTS.extend(range(have, max(n, 2 * have)))
    return _SLOTS


def typecode_of(arrow_type: pa.DataType | None) -> str | None:
    """The ``array`` typecode storing values of ``arrow_type`` unboxed, or ``None``."""
    code = _TYPECODES.get(arrow_type) if arrow_type is not None else None
    if code is None or array(code).itemsize * 8 != arrow_type.bit_width:
        return None
    return code


@dataclass
class Captured:
    """What :meth:`Column.capture` copied.

    ``keys``/``values``/``nulls`` are rows: the whole key group when ``all_rows``, else only
    the changed slots. ``changed``: positions of the changed rows within them (``None``: every
    row changed or the rows are the changed ones). ``deleted``: keys deleted since the last
    confirmed capture (absent from the rows). ``complete``: the rows of the delta are the key
    group's full image (its deletes are then redundant).
    """

    keys: np.ndarray | list
    values: np.ndarray | list | None  # a list of objects (OBJECTS); None once a ColumnDelta froze them
    nulls: np.ndarray | None
    changed: np.ndarray | None
    deleted: list
    all_rows: bool
    complete: bool

    def __reduce__(self) -> tuple:
        # small arrays as (dtype, bytes): numpy's own pickling costs ~8 us an array, most of a
        # small key group's trip to the writer process (a few keys each at a large max_parallelism)
        return _captured, (pack_small_array(self.keys), pack_small_array(self.values), pack_small_array(self.nulls),
                           pack_small_array(self.changed), self.deleted, self.all_rows, self.complete)

    def delta_rows(self, values: np.ndarray | list | None = None) -> tuple[np.ndarray | list, np.ndarray | list, np.ndarray | None]:
        """Keys, values and null mask of the changed rows; ``values``: the rows' values when
        they are not in :attr:`values` (objects frozen by a pickle, see ``ColumnDelta``)."""
        if values is None:
            values = self.values
        if self.changed is None:
            return self.keys, values, self.nulls
        at = self.changed
        keys = self.keys[at] if isinstance(self.keys, np.ndarray) else [self.keys[i] for i in at.tolist()]
        if isinstance(values, list):
            return keys, [values[i] for i in at.tolist()], None
        return keys, values[at], None if self.nulls is None else self.nulls[at]


_PACK_BELOW = 4096  # bytes: arrays smaller than this pickle as their bytes (see Captured.__reduce__)


def pack_small_array(a: Any) -> Any:
    """A small C-contiguous numpy array of a plain dtype as ``(dtype string, bytes)``, for
    :func:`unpack_small_array`; anything else as it is (large arrays go out of band in a
    frame). For the ``__reduce__`` of what goes to the writer process per key group
    (:class:`Captured`, :class:`abs.state.varkeys.VarKeys`)."""
    if type(a) is np.ndarray and a.nbytes < _PACK_BELOW and a.dtype.kind in "biufcmM" and a.flags.c_contiguous \
            and a.ndim == 1:
        return (a.dtype.str, a.tobytes())
    return a


def unpack_small_array(a: Any) -> Any:
    """What :func:`pack_small_array` packed, as a writable array; anything else as it is."""
    if type(a) is tuple:
        return np.frombuffer(bytearray(a[1]), np.dtype(a[0]))  # writable, as the array was
    return a


def _captured(keys: Any, values: Any, nulls: Any, changed: Any, deleted: list, all_rows: bool,
              complete: bool) -> Captured:
    return Captured(unpack_small_array(keys), unpack_small_array(values), unpack_small_array(nulls),
                    unpack_small_array(changed), deleted, all_rows, complete)


class Column:
    """One key group of a columnar value state (see the module docstring)."""

    # image: a restored key group's arrays until it is first used, then its index while it is
    # probed (abs.state.restored)
    __slots__ = ("index", "keys", "values", "stamps", "nulls", "deleted", "dtype", "objects", "image")

    def __init__(self, typecode: str) -> None:
        self.index: dict = {}
        self.keys: array | list = array("q")
        self.objects = typecode == OBJECTS
        self.values: array | list = [] if self.objects else array(typecode)
        self.stamps = array("q")
        self.nulls: set[int] = set()  # stays empty in an OBJECTS column
        self.deleted: dict = {}
        self.dtype = None if self.objects else np.dtype(typecode)

    # ------------------------------------------------------------------ dict-like reads
    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, key: Any) -> bool:
        return key in self.index

    def get(self, key: Any, default: Any = None) -> Any:
        i = self.index.get(key)
        if i is None:
            return default
        return None if i in self.nulls else self.values[i]

    def items(self) -> Iterator[tuple[Any, Any]]:
        nulls, values = self.nulls, self.values
        for key, i in self.index.items():
            yield key, None if i in nulls else values[i]

    # ------------------------------------------------------------------ writes
    def set(self, key: Any, value: Any, epoch: int) -> None:
        """Insert or overwrite ``key``. ``TypeError`` (unhashable key, a value of another
        type) or ``OverflowError`` leave the column unchanged."""
        i = self.index.get(key)
        if i is None:
            self.insert(key, value, epoch)
            return
        if self.objects:
            self.values[i] = value
            self.stamps[i] = epoch
            return
        self.values[i] = 0 if value is None else value
        self.stamps[i] = epoch
        if value is None:
            self.nulls.add(i)
        elif self.nulls:
            self.nulls.discard(i)

    def insert(self, key: Any, value: Any, epoch: int) -> None:
        """Append ``key``, which the caller found absent. Errors as :meth:`set`."""
        values = self.values
        objects = self.objects
        values.append(value if value is not None or objects else 0)
        keys = self.keys
        if type(key) is int and type(keys) is array and _I64_MIN <= key <= _I64_MAX:
            keys.append(key)
        else:
            try:
                self._append_key(key)
            except BaseException:
                values.pop()
                raise
        stamps = self.stamps
        i = len(stamps)
        stamps.append(epoch)
        self.index[key] = _SLOTS[i] if i < len(_SLOTS) else _slots(i + 1)[i]
        if self.deleted:
            self.deleted.pop(key, None)
        if value is None and not objects:
            self.nulls.add(i)

    def _append_key(self, key: Any) -> None:
        keys = self.keys
        if isinstance(keys, array):
            if type(key) is int and _I64_MIN <= key <= _I64_MAX:
                keys.append(key)
                return
            self.keys = keys = keys.tolist()  # from now on a list: any hashable key
        keys.append(key)

    def delete(self, key: Any, epoch: int) -> bool:
        """Remove ``key``; False when it was absent."""
        i = self.index.pop(key, None)
        if i is None:
            return False
        last = len(self.stamps) - 1
        keys, values, stamps, nulls = self.keys, self.values, self.stamps, self.nulls
        if i != last:  # move the last slot into the hole
            moved = keys[last]
            keys[i] = moved
            values[i] = values[last]
            stamps[i] = stamps[last]
            self.index[moved] = i
            if nulls:
                moved_null = last in nulls
                nulls.discard(last)
                nulls.discard(i)
                if moved_null:
                    nulls.add(i)
        else:
            nulls.discard(i)
        keys.pop()
        values.pop()
        stamps.pop()
        self.deleted[key] = epoch
        return True

    def load(self, keys: np.ndarray | list, values: np.ndarray | list, nulls: np.ndarray | None) -> bool:
        """Bulk-load unique ``keys`` into an empty column, stamped 0 (not dirty). False (and
        nothing loaded) when the column is not empty or the keys repeat. ``values``: a list
        of the objects in an :data:`OBJECTS` column (``nulls`` is then ignored)."""
        if self.index:
            return False
        n = len(keys)
        if len(values) != n:
            return False
        index = dict(zip(keys.tolist() if isinstance(keys, np.ndarray) else keys, _slots(n)))  # zip stops at the keys
        if len(index) != n:
            return False
        if isinstance(keys, np.ndarray):
            self.keys = array("q", np.ascontiguousarray(keys, dtype=np.int64).tobytes())
        else:
            self.keys = _key_storage(keys)
        if self.objects:
            self.values = list(values)
            self.stamps = array("q", bytes(8 * n))
            self.index = index
            return True
        self.values = array(self.values.typecode, np.ascontiguousarray(values, dtype=self.dtype).tobytes())
        self.stamps = array("q", bytes(8 * n))
        self.index = index
        self.nulls = set(np.flatnonzero(nulls).tolist()) if nulls is not None else set()
        return True

    def fold(self, keys: list, partials: np.ndarray, fn: str, epoch: int) -> np.ndarray | None:
        """Fold per-key partial results (``fn``: ``sum``, ``count``, ``min`` or ``max``, as the
        aggregate merges them) into distinct ``keys`` with one numpy operation, new keys
        inserted with their partial; returns the merged values in ``keys`` order. ``None``,
        with nothing changed, where the merge must go key by key: an untyped column or one of
        another type than int64/float64 or ``partials``, a column holding a null, or an int64
        sum or count that may leave int64 (the key-by-key path keeps exact ints and fails
        with a message)."""
        if self.objects or self.nulls or self.dtype not in _FOLD_DTYPES or partials.dtype != self.dtype:
            return None
        ufunc = _FOLDS[fn][self.dtype.kind]
        slots = np.fromiter(map(self.index.get, keys, itertools.repeat(-1)), dtype=np.int64, count=len(keys))
        found = slots >= 0
        merged = partials.copy()
        if found.any():
            at = slots[found]
            values = np.frombuffer(self.values, dtype=self.dtype)
            old = values[at]
            part = partials[found]
            if fn in ("sum", "count") and self.dtype.kind == "i":
                bound = np.abs(old.astype(np.float64)).max() + np.abs(part.astype(np.float64)).max()
                if bound >= _FOLD_INT_LIMIT:
                    return None
            new = ufunc(old, part)
            values[at] = new
            np.frombuffer(self.stamps, dtype=np.int64)[at] = epoch
            merged[found] = new
            del values  # release the buffer: inserts grow the array
        if not found.all():
            for i in np.flatnonzero(~found).tolist():
                self.insert(keys[i], partials[i].item(), epoch)
        return merged

    # ------------------------------------------------------------------ snapshots
    def capture(self, since: int, *, full: bool = False) -> Captured | None:
        """Copy what changed after epoch ``since`` (everything with ``full``); ``None`` when
        nothing did. Runs in the synchronous part of a snapshot."""
        n = len(self.stamps)
        deleted = [k for k, e in self.deleted.items() if e > since] if self.deleted else []
        if full:
            if not n:
                return None
            changed = None
            share = 1.0
        else:
            changed = np.flatnonzero(np.frombuffer(self.stamps, dtype=np.int64) > since) if n else np.empty(0, np.int64)
            if not len(changed) and not deleted:
                return None
            share = len(changed) / n if n else 0.0
        complete = n > 0 and share >= _IMAGE_SHARE
        all_rows = full or share >= _COPY_ALL_SHARE
        keys_view = np.frombuffer(self.keys, dtype=np.int64) if isinstance(self.keys, array) and n else None
        values_view: Any
        if self.objects:
            values_view = self.values  # references: ColumnDelta freezes them with one pickle
        else:
            values_view = np.frombuffer(self.values, dtype=self.dtype) if n else np.empty(0, self.dtype)
        nulls = None
        values: np.ndarray | list
        if all_rows:
            keys: np.ndarray | list = keys_view.copy() if keys_view is not None else list(self.keys)
            values = values_view.copy()
            nulls = self.null_mask(None)
            if complete:
                changed = None
        else:
            assert changed is not None
            keys = keys_view[changed] if keys_view is not None else [self.keys[i] for i in changed.tolist()]
            values = [values_view[i] for i in changed.tolist()] if self.objects else values_view[changed]
            nulls = self.null_mask(changed)
            changed = None
        del keys_view, values_view  # release the buffers: the arrays may grow again
        # deletes stay in a complete delta too: harmless in a new base, and right should the
        # delta be appended to the chain by a writer that ignores ``complete``
        return Captured(keys=keys, values=values, nulls=nulls, changed=changed, deleted=deleted,
                        all_rows=all_rows, complete=complete)

    def null_mask(self, rows: np.ndarray | None) -> np.ndarray | None:
        """Which of the slots ``rows`` (None: every slot) hold ``None``, as a capture gives it:
        a bool mask, or None when no slot does."""
        if not self.nulls:
            return None
        if rows is None:
            mask = np.zeros(len(self.stamps), dtype=bool)
            mask[list(self.nulls)] = True
            return mask
        return np.isin(rows, np.fromiter(self.nulls, dtype=np.int64, count=len(self.nulls)))

    def forget_deletes(self, upto: int) -> None:
        """Drop the deletes of epochs ``<= upto`` (a confirmed capture holds them)."""
        if self.deleted:
            self.deleted = {k: e for k, e in self.deleted.items() if e > upto}


class KeyOrders:
    """The sort order of each key group's integer keys, kept from one snapshot to the next.

    Files store their rows sorted by key (``storage/FORMAT.md``), and a column's slots are in
    insertion order, so every full image needs a sort. When every key of a key group was
    written again between two snapshots (a state whose keys all change each interval: the
    images are then the snapshots) its key array is usually the very same, and :meth:`sort`
    returns the order it computed last time after one comparison of the arrays (~6 us for
    7.8k keys, against ~100 us for the ``argsort``). An insert or a delete changes the array
    (a delete moves the last slot into the hole), and the keys are sorted afresh. Merging
    appended slots into the known order was measured no faster than numpy's ``argsort``.

    The keys of one ``slot`` must be unique (they are: they come from one :class:`Column`).
    Holds a copy of the keys, their order and the sorted keys per slot (24 bytes per key): a
    remembered order also spares the gather of the sorted keys (~1.5 ms of the writer's ~30
    per checkpoint of 500k keys). Used by one writer process (:mod:`abs.runtime.writer`), one
    thread per slot at a time.
    """

    def __init__(self) -> None:
        self._known: dict[Any, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._text: dict[Any, tuple[np.ndarray | None, pa.Array | list]] = {}
        self._derived: dict[Any, tuple[np.ndarray, Any]] = {}

    def sort(self, slot: Any, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(order, keys[order])`` for unique int64 ``keys``; remembered for ``slot``. The
        arrays returned are shared with later calls, and read-only."""
        known = self._known.get(slot)
        if known is not None and len(known[0]) == len(keys) and np.array_equal(known[0], keys):
            return known[1], known[2]
        order = np.argsort(keys)
        ordered = keys[order]
        order.flags.writeable = ordered.flags.writeable = False  # shared with later calls
        self._known[slot] = (keys.copy(), order, ordered)
        return order, ordered

    def derived(self, slot: Any, ordered: np.ndarray, make: Callable[[np.ndarray], Any]) -> Any:
        """``make(ordered)`` for the sorted keys :meth:`sort` returned for ``slot``, remembered
        while it returns that very array (the keys' digest of a values image: the same at every
        checkpoint of a key group whose keys stay)."""
        memo = self._derived.get(slot)
        if memo is not None and memo[0] is ordered:
            return memo[1]
        value = make(ordered)
        self._derived[slot] = (ordered, value)
        return value

    def sort_text(self, slot: Any, keys: list) -> tuple[np.ndarray | None, pa.Array | list]:
        """``(order, keys in that order as an Arrow string or binary array)`` for the unique
        keys of a full image when they are all ``str`` or all ``bytes`` (the array
        ``abs.state``'s encoding makes of them), else ``(None, keys)``; remembered for
        ``slot`` until the next call (:meth:`text`). The writer process calls it for every
        full image of such keys it receives, and :meth:`text` when the worker sent
        :class:`SameKeys` instead of keys it had sent before: their Arrow array, sort
        order and the sort are then spared, as is pickling them through the pipe."""
        arr = _text_array(keys)
        if arr is None:
            got: tuple = (None, keys)
        elif len(arr) <= _SMALL_SORT:  # a compute call and a take cost ~15 us whatever the length
            listed = arr.to_pylist() if isinstance(keys, pa.Array) else keys
            order = sorted(range(len(listed)), key=listed.__getitem__)
            ordered = _text_array([listed[i] for i in order])
            got = (np.array(order, dtype=np.int32), ordered if ordered is not None else arr.take(pa.array(order)))
        else:
            indices = pc.sort_indices(arr)  # taken as Arrow indices: no conversion from numpy and back
            # kept as int32 where it fits: with the sorted keys ~14 bytes a key of a string
            # state, held by the writer process between checkpoints
            order = indices.to_numpy()
            got = (order.astype(np.int32) if len(order) < 2**31 else order, arr.take(indices))
        self._text[slot] = got
        return got

    def text(self, slot: Any) -> tuple[np.ndarray | None, pa.Array | list] | None:
        """What :meth:`sort_text` last returned for ``slot`` (``None``: never called)."""
        return self._text.get(slot)


_SMALL_SORT = 64
"""Full images of at most this many ``str`` or ``bytes`` keys are sorted as Python objects
(the order Arrow gives them: ``str`` by code point, which UTF-8 keeps, ``bytes`` byte by byte)."""


class SameKeys:
    """Stands, in a full image the worker sends its writer process, for the ``n`` keys of the
    full image of the same key group it sent last (see :meth:`KeyOrders.sort_text`)."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __reduce__(self) -> tuple:
        return SameKeys, (self.n,)


def _text_array(keys: list) -> pa.Array | None:
    """``keys`` as an Arrow string (all ``str``) or binary (all ``bytes``) array, else None.

    The C module copies a list's keys into the array's buffers; pyarrow's converter of Python
    objects took ~0.2 us a key in order of creation and ~0.35 us in another order (1.8 s of
    a worker's GIL for the 5 M keys of a full snapshot). It leaves the rare cases (mixed types,
    lone surrogates, over 2 GiB of keys) to pyarrow, whose results define the C one's."""
    if isinstance(keys, pa.Array):
        return keys
    if NATIVE is not None and type(keys) is list:
        offsets = np.empty(len(keys) + 1, np.int32)
        got = NATIVE.text_array(keys, offsets)
        if got is not None:
            is_bytes, data = got
            return pa.Array.from_buffers(pa.binary() if is_bytes else pa.string(), len(keys),
                                         [None, pa.py_buffer(offsets), pa.py_buffer(data)])
    types = set(map(type, keys))
    t = pa.string() if types == {str} else pa.binary() if types == {bytes} else None
    if t is None:
        return None
    try:
        return pa.array(keys, t)
    except (pa.ArrowInvalid, pa.ArrowTypeError, UnicodeEncodeError):
        return None  # lone surrogates: pickled by the encoding


def _key_storage(keys: list) -> array | list:
    """``keys`` as :attr:`Column.keys` holds them: an ``array('q')`` while every key is an
    ``int`` in int64 range (not a ``bool``), else a list."""
    if all(type(k) is int for k in keys):
        try:
            return array("q", keys)
        except OverflowError:
            pass
    return list(keys)
