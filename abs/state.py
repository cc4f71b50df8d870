"""Keyed state: declared state descriptors and an in-memory backend that tracks, per key
group, the keys changed since the last confirmed checkpoint.

Descriptors
===========
``ValueState(name, type=None)``, ``ListState(name, element_type=None)``,
``MapState(name, key_type=None, value_type=None)``, ``ReducingState(name, reduce_fn, type=None)``.
A declared Arrow type makes snapshots real Arrow columns (readable by pyarrow and Spark);
without one, values are pickled into a binary column.

The backend and the hot path
============================
:class:`KeyedStateBackend` keeps, per declared state, one ``dict`` (key -> value) per key
group of its :class:`~abs.keygroups.KeyGroupRange` (value states of a fixed-width numeric
type or untyped: a :class:`~abs.columns.Column`), in a list indexed by the *absolute* key
group (slots of key groups outside the range are ``None``).  Before calling user code for a
record, the runtime sets the current key with two plain attribute writes, no method call::

    backend.current_key = key
    backend.current_kg = kg          # key_group(key, max_parallelism)

State handles (``backend.state(name)``) read those two attributes on each call.  What is
checked, and when:

* ``current_kg`` outside the backend's range (or unset) is detected for free: the lookup
  hits a ``None`` slot or the end of the list and the handle raises :class:`StateError`.
  A *negative* ``current_kg`` is not detected (Python list indexing); key groups computed by
  :func:`~abs.keygroups.key_group` are never negative.
* That ``current_kg`` is the key group of ``current_key`` is **not** checked per call; use
  :meth:`KeyedStateBackend.set_current_key` where speed does not matter.
* Values returned by ``value()``/``get()`` of value, reducing and map states are the live
  stored objects: mutate state only through ``update``/``add``/``put``, otherwise the change is
  invisible to dirty tracking and missing from the next incremental checkpoint.
  ``ListState.get()`` returns a copy.

Snapshots
=========
Every write adds the key to the per-key-group *dirty set* of its state (one ``set.add``), or,
in a columnar key group (value states of a fixed-width numeric type or untyped, see
:mod:`abs.columns`), stamps its slot with the current epoch.
:meth:`KeyedStateBackend.capture` (the synchronous part of a snapshot) returns, for every key
group with keys changed since the last **confirmed** checkpoint, a delta table
(``key``, ``value``, ``op``: 0 upsert, 1 delete), values copied into Arrow (or pickled) at once.
Because a delta covers everything since the last confirmed checkpoint ``c`` (the value of
:attr:`KeyedStateBackend.last_confirmed` when it was captured), the state at checkpoint ``n`` is
``chain(b) + delta(n)`` for any *completed* checkpoint ``b`` with ``c <= b < n`` (``c`` itself
always works).  Captured-but-unconfirmed checkpoints may overlap (``max_concurrent > 1``);
:meth:`confirm` forgets what was captured by checkpoints ``<= id``; :meth:`abort` forgets
nothing.

Table encoding: the key column is ``int64``, ``string`` or ``binary`` when every key of the
table is an ``int`` (in int64 range), a ``str`` or a ``bytes``; otherwise a ``binary`` column of
pickled keys.  The value column has the state's Arrow type (see ``value_arrow_type()``), or is
a ``binary`` column of pickled values (pickle protocol 5).  Deleted keys have a null value.
Schema metadata: ``abs.key_encoding`` (``arrow``|``pickle``), ``abs.value_encoding``
(``arrow``|``pickle``), ``abs.state_kind``.  :meth:`KeyedStateBackend.restore` is the inverse.
"""
from __future__ import annotations

import itertools
import operator
import pickle
from dataclasses import dataclass, replace
from typing import Any, Callable, ClassVar, Iterable, Iterator, Sequence, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from abs.columns import OBJECTS, Captured, Column, KeyOrders, typecode_of
from abs.errors import ConfigError, StateError
from abs.keygroups import KeyGroupRange, check_max_parallelism, key_group

__all__ = [
    "ColumnDelta",
    "PendingDelta",
    "PickledDelta",
    "ValueState",
    "ListState",
    "MapState",
    "ReducingState",
    "StateDescriptor",
    "KeyedStateBackend",
    "ValueStateHandle",
    "ListStateHandle",
    "MapStateHandle",
    "ReducingStateHandle",
    "OP_UPSERT",
    "OP_DELETE",
    "META_KEY_ENCODING",
    "META_VALUE_ENCODING",
    "META_STATE_KIND",
]

OP_UPSERT = 0
OP_DELETE = 1
META_KEY_ENCODING = b"abs.key_encoding"
META_VALUE_ENCODING = b"abs.value_encoding"
META_STATE_KIND = b"abs.state_kind"
_PICKLE_PROTOCOL = 5
_MISSING: Any = object()


# ----------------------------------------------------------------------------- descriptors


def _check_name(cls: str, name: Any) -> None:
    if not isinstance(name, str) or not name or any(c in name for c in "/\\\0"):
        raise ConfigError(
            f"{cls} name must be a non-empty str without '/', '\\' or NUL (it names storage "
            f"folders), got {name!r}; choose a name like 'count'"
        )


def _check_type(cls: str, name: str, field: str, value: Any) -> None:
    if value is not None and not isinstance(value, pa.DataType):
        raise ConfigError(
            f"{cls}({name!r}): {field} must be a pyarrow DataType or None, got {value!r}; "
            "pass e.g. pyarrow.int64(), or None to store pickled values"
        )


def _type_json(t: pa.DataType | None) -> str | None:
    return None if t is None else str(t)


@dataclass(frozen=True)
class ValueState:
    """One value per key. ``type``: Arrow type of the value, or None (pickled)."""

    name: str
    type: pa.DataType | None = None
    kind: ClassVar[str] = "value"

    def __post_init__(self) -> None:
        _check_name("ValueState", self.name)
        _check_type("ValueState", self.name, "type", self.type)

    def value_arrow_type(self) -> pa.DataType | None:
        """Arrow type of the snapshot's value column; None means pickled binary."""
        return self.type

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "type": _type_json(self.type)}


@dataclass(frozen=True)
class ListState:
    """A list of elements per key. ``element_type``: Arrow type of one element, or None."""

    name: str
    element_type: pa.DataType | None = None
    kind: ClassVar[str] = "list"

    def __post_init__(self) -> None:
        _check_name("ListState", self.name)
        _check_type("ListState", self.name, "element_type", self.element_type)

    def value_arrow_type(self) -> pa.DataType | None:
        return None if self.element_type is None else pa.list_(self.element_type)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "element_type": _type_json(self.element_type)}


@dataclass(frozen=True)
class MapState:
    """A map per key. Give both ``key_type`` and ``value_type`` (typed) or neither (pickled)."""

    name: str
    key_type: pa.DataType | None = None
    value_type: pa.DataType | None = None
    kind: ClassVar[str] = "map"

    def __post_init__(self) -> None:
        _check_name("MapState", self.name)
        _check_type("MapState", self.name, "key_type", self.key_type)
        _check_type("MapState", self.name, "value_type", self.value_type)
        if (self.key_type is None) != (self.value_type is None):
            raise ConfigError(
                f"MapState({self.name!r}): give both key_type and value_type, or neither "
                "(then the map is pickled)"
            )

    def value_arrow_type(self) -> pa.DataType | None:
        if self.key_type is None or self.value_type is None:
            return None
        return pa.map_(self.key_type, self.value_type)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "name": self.name,
            "key_type": _type_json(self.key_type),
            "value_type": _type_json(self.value_type),
        }


@dataclass(frozen=True)
class ReducingState:
    """One value per key folded with ``reduce_fn(accumulated, new)`` on each ``add``."""

    name: str
    reduce_fn: Callable[[Any, Any], Any]
    type: pa.DataType | None = None
    kind: ClassVar[str] = "reducing"

    def __post_init__(self) -> None:
        _check_name("ReducingState", self.name)
        if not callable(self.reduce_fn):
            raise ConfigError(
                f"ReducingState({self.name!r}): reduce_fn must be callable, got "
                f"{self.reduce_fn!r}; pass a function (accumulated, value) -> accumulated"
            )
        _check_type("ReducingState", self.name, "type", self.type)

    def value_arrow_type(self) -> pa.DataType | None:
        return self.type

    def to_json(self) -> dict[str, Any]:
        fn = self.reduce_fn
        qualname = getattr(fn, "__qualname__", type(fn).__qualname__)
        module = getattr(fn, "__module__", None) or type(fn).__module__
        return {
            "kind": self.kind,
            "name": self.name,
            "type": _type_json(self.type),
            "reduce_fn": f"{module}.{qualname}",
        }


StateDescriptor = Union[ValueState, ListState, MapState, ReducingState]
_KINDS = {"value": ValueState, "list": ListState, "map": MapState, "reducing": ReducingState}


# ----------------------------------------------------------------------------- handles
# Hot path. Each handle holds the backend and the two per-key-group lists of its state
# (``_data[kg]``: dict key -> value, ``_dirty[kg]``: set of changed keys). A lookup error
# (None slot, index past the end, unset kg) is turned into a StateError by ``_fail``, which
# re-raises the original exception when the key group is fine (unhashable key, an error in
# a reduce function...).


class _Handle:
    __slots__ = ("_backend", "_data", "_dirty", "_deleted", "name")

    def __init__(self, backend: KeyedStateBackend, name: str, data: list, dirty: list) -> None:
        self._backend = backend
        self._data = data
        self._dirty = dirty
        self._deleted: set = set()  # replaced by its slot's set: key groups with a delete since the last capture
        self.name = name

    def _fail(self) -> None:
        self._backend._check_current_kg(self.name)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._backend.operator_uid}/{self.name}>"


class ValueStateHandle(_Handle):
    """Handle of a :class:`ValueState` scoped to the backend's current key."""

    __slots__ = ()

    def value(self) -> Any:
        """The value of the current key, or None if it has none."""
        b = self._backend
        try:
            return self._data[b.current_kg].get(b.current_key)
        except (TypeError, AttributeError, IndexError):
            self._fail()
            raise

    def update(self, value: Any) -> None:
        """Set the value of the current key (None is stored as a value; use clear())."""
        b = self._backend
        kg = b.current_kg
        key = b.current_key
        try:
            self._data[kg][key] = value
            self._dirty[kg].add(key)
        except (TypeError, AttributeError, IndexError):
            self._fail()
            raise

    def clear(self) -> None:
        """Delete the current key's value."""
        b = self._backend
        kg = b.current_kg
        key = b.current_key
        try:
            if self._data[kg].pop(key, _MISSING) is not _MISSING:
                self._dirty[kg].add(key)
                self._deleted.add(kg)
        except (TypeError, AttributeError, IndexError):
            self._fail()
            raise


class ColumnValueStateHandle(_Handle):
    """Handle of a :class:`ValueState` of a fixed-width numeric type, or untyped, kept in
    :class:`~abs.columns.Column` key groups (``_data[kg]``). Same API as
    :class:`ValueStateHandle`; a value the declared type cannot hold is refused at once.

    :meth:`value` remembers where it found the current key (the key object, its column and
    slot), so the :meth:`update` of a read-modify-write, which nearly every process function
    does, writes there without a second lookup when the current key is the same object.
    Only a delete moves a slot (the last one into the hole), so :meth:`clear` and the
    backend's bulk deletes and restores forget the remembered slot (:meth:`_forget`)."""

    __slots__ = ("_hit_key", "_hit_col", "_hit_slot")

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._forget()

    def _forget(self) -> None:
        self._hit_key: Any = _MISSING
        self._hit_col: Any = None
        self._hit_slot = -1

    def value(self) -> Any:
        """The value of the current key, or None if it has none."""
        b = self._backend
        key = b.current_key
        try:
            col = self._data[b.current_kg]
            i = col.index.get(key)
        except (TypeError, AttributeError, IndexError):
            self._fail()
            raise
        if i is None or (col.nulls and i in col.nulls):
            return None
        self._hit_key = key
        self._hit_col = col
        self._hit_slot = i
        return col.values[i]

    def update(self, value: Any) -> None:
        """Set the value of the current key (None is stored as a value; use clear())."""
        b = self._backend
        key = b.current_key
        try:
            if key is self._hit_key:
                col = self._hit_col
                i = self._hit_slot
            else:
                col = self._data[b.current_kg]
                i = col.index.get(key)
            if i is None:
                col.insert(key, value, b.epoch)
                return
            if not col.nulls:
                col.values[i] = value
                col.stamps[i] = b.epoch
                return
        except (TypeError, OverflowError, AttributeError, IndexError):
            pass  # nothing changed; the checked path below names the problem
        self._update_checked(value)

    def _update_checked(self, value: Any) -> None:
        b = self._backend
        try:
            col = self._data[b.current_kg]
        except (TypeError, IndexError):
            self._fail()
            raise
        if col is None:
            self._fail()  # the key group is outside the range: StateError
        b._column_set(b._slot(self.name), col, b.current_key, value, b.epoch)

    def clear(self) -> None:
        """Delete the current key's value."""
        b = self._backend
        self._forget()
        try:
            self._data[b.current_kg].delete(b.current_key, b.epoch)
        except (TypeError, AttributeError, IndexError):
            self._fail()
            raise


def _hashable(key: Any) -> bool:
    try:
        hash(key)
    except TypeError:
        return False
    return True


class ListStateHandle(_Handle):
    """Handle of a :class:`ListState` scoped to the backend's current key."""

    __slots__ = ()

    def get(self) -> list:
        """A copy of the current key's list ([] when it has none)."""
        b = self._backend
        try:
            lst = self._data[b.current_kg].get(b.current_key)
        except (TypeError, AttributeError, IndexError):
            self._fail()
            raise
        return [] if lst is None else lst.copy()

    def add(self, value: Any) -> None:
        """Append ``value`` to the current key's list."""
        b = self._backend
        kg = b.current_kg
        key = b.current_key
        try:
            d = self._data[kg]
            lst = d.get(key)
            if lst is None:
                d[key] = [value]
            else:
                lst.append(value)
            self._dirty[kg].add(key)
        except (TypeError, AttributeError, IndexError):
            self._fail()
            raise

    def update(self, values: Iterable[Any]) -> None:
        """Replace the current key's list (an empty list deletes it)."""
        b = self._backend
        kg = b.current_kg
        key = b.current_key
        new = list(values)
        try:
            d = self._data[kg]
            if new:
                d[key] = new
            elif d.pop(key, _MISSING) is _MISSING:
                return
            self._dirty[kg].add(key)
        except (TypeError, AttributeError, IndexError):
            self._fail()
            raise

    def clear(self) -> None:
        b = self._backend
        kg = b.current_kg
        key = b.current_key
        try:
            if self._data[kg].pop(key, _MISSING) is not _MISSING:
                self._dirty[kg].add(key)
                self._deleted.add(kg)
        except (TypeError, AttributeError, IndexError):
            self._fail()
            raise


_EMPTY: dict = {}


class MapStateHandle(_Handle):
    """Handle of a :class:`MapState` scoped to the backend's current key.

    An empty map is never stored: removing the last entry deletes the key.
    """

    __slots__ = ()

    def _map(self) -> dict:
        b = self._backend
        try:
            return self._data[b.current_kg].get(b.current_key, _EMPTY)
        except (TypeError, AttributeError, IndexError):
            self._fail()
            raise

    def get(self, map_key: Any, default: Any = None) -> Any:
        b = self._backend
        try:
            m = self._data[b.current_kg].get(b.current_key)
        except (TypeError, AttributeError, IndexError):
            self._fail()
            raise
        if m is None:
            return default
        return m.get(map_key, default)

    def put(self, map_key: Any, value: Any) -> None:
        b = self._backend
        kg = b.current_kg
        key = b.current_key
        try:
            d = self._data[kg]
            m = d.get(key)
            if m is None:
                d[key] = {map_key: value}
            else:
                m[map_key] = value
            self._dirty[kg].add(key)
        except (TypeError, AttributeError, IndexError):
            self._fail()
            raise

    def remove(self, map_key: Any) -> None:
        b = self._backend
        kg = b.current_kg
        key = b.current_key
        try:
            d = self._data[kg]
            m = d.get(key)
            if m is None or m.pop(map_key, _MISSING) is _MISSING:
                return
            if not m:
                del d[key]
            self._dirty[kg].add(key)
        except (TypeError, AttributeError, IndexError):
            self._fail()
            raise

    def contains(self, map_key: Any) -> bool:
        return map_key in self._map()

    def items(self) -> Any:
        """A read-only view of the current key's entries."""
        return self._map().items()

    def keys(self) -> Any:
        return self._map().keys()

    def values(self) -> Any:
        return self._map().values()

    def is_empty(self) -> bool:
        return not self._map()

    def clear(self) -> None:
        b = self._backend
        kg = b.current_kg
        key = b.current_key
        try:
            if self._data[kg].pop(key, _MISSING) is not _MISSING:
                self._dirty[kg].add(key)
        except (TypeError, AttributeError, IndexError):
            self._fail()
            raise


class ReducingStateHandle(_Handle):
    """Handle of a :class:`ReducingState` scoped to the backend's current key."""

    __slots__ = ("_fn",)

    def __init__(self, backend: KeyedStateBackend, name: str, data: list, dirty: list, fn: Callable) -> None:
        super().__init__(backend, name, data, dirty)
        self._fn = fn

    def get(self) -> Any:
        b = self._backend
        try:
            return self._data[b.current_kg].get(b.current_key)
        except (TypeError, AttributeError, IndexError):
            self._fail()
            raise

    def add(self, value: Any) -> None:
        """Fold ``value`` into the current key's accumulator (the first value is stored as is)."""
        b = self._backend
        kg = b.current_kg
        key = b.current_key
        try:
            d = self._data[kg]
            acc = d.get(key, _MISSING)
            d[key] = value if acc is _MISSING else self._fn(acc, value)
            self._dirty[kg].add(key)
        except (TypeError, AttributeError, IndexError):
            self._fail()
            raise

    def clear(self) -> None:
        b = self._backend
        kg = b.current_kg
        key = b.current_key
        try:
            if self._data[kg].pop(key, _MISSING) is not _MISSING:
                self._dirty[kg].add(key)
        except (TypeError, AttributeError, IndexError):
            self._fail()
            raise


# ----------------------------------------------------------------------------- backend


class PendingDelta:
    """A delta captured by reference (see :meth:`KeyedStateBackend.capture` with ``lazy``),
    encoded to Arrow by :meth:`to_table` in the asynchronous part.

    The synchronous part costs at most about one C-level dict copy per changed key group:
    the changed-key sets are frozen objects already (capture swaps in fresh ones), and the
    values are frozen either by looking up the changed keys now (when they are few) or by
    copying the key group's dict (``dict.copy`` runs at C speed, cheaper than a Python
    loop once more than about a tenth of the key group changed).
    """

    __slots__ = ("_backend", "_slot", "_kg", "_key_sets", "_frozen", "_keys", "_values", "_deletes", "complete")

    def __init__(self, backend: "KeyedStateBackend", slot: "_StateSlot", kg: int, key_sets: list, d: dict,
                 deletes: bool = True) -> None:
        self._backend = backend
        self._slot = slot
        self._kg = kg
        self._key_sets = key_sets
        self._deletes = deletes  # False: every changed key is still in the dict
        self.complete = False  # set by to_table/image: the table holds every live key of the key group
        if sum(len(ks) for ks in key_sets) * 10 < len(d):
            self._keys = list(key_sets[0]) if len(key_sets) == 1 else list(set().union(*key_sets))
            get = d.get
            self._values: list | None = list(map(get, self._keys, itertools.repeat(_MISSING)))
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
            values = list(map(get, keys, itertools.repeat(_MISSING)))
        return self._backend._encode_pairs(self._slot, self._kg, keys, values, with_op=True, deletes=deletes)

    def image(self) -> pa.Table | None:
        """The key group's full live state at the capture as upserts (sets ``complete``), or
        ``None`` when the capture froze only the changed keys (or the key group is empty).
        The store calls it instead of reading the previous chain back when its policy
        compacts the chain."""
        frozen = self._frozen
        if not frozen:
            return None
        self.complete = True
        return self._backend._encode_pairs(self._slot, self._kg, list(frozen), list(frozen.values()),
                                           with_op=True, deletes=False)


# A lazily captured key group is written as its full image when at least 3/4 of its live keys
# changed: the file is at most 4/3 of the delta's, and the chain restarts at length 1.
_IMAGE_NUMERATOR, _IMAGE_DENOMINATOR = 3, 4


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
            order, ordered = orders.sort(slot, self._captured.keys)
            memo = self._sorted = (orders, slot, order, ordered)
        return memo[2], memo[3]

    def __getstate__(self) -> tuple:
        return self._captured, self._arrow_type, self._kind, self._blob

    def __setstate__(self, state: tuple) -> None:
        self.__init__(*state)  # type: ignore[misc]

    def _values(self) -> np.ndarray | list:
        return self._captured.values if self._blob is None else pickle.loads(self._blob)

    def to_table(self, orders: KeyOrders | None = None, slot: Any = None) -> pa.Table:
        """The delta as a table. ``orders``: when the rows are the key group's full image
        (integer keys, no deletes), they come out sorted by key in the order ``orders``
        keeps for ``slot``, and the store's sort finds them sorted."""
        c = self._captured
        keys, values, nulls = c.delta_rows(self._values())
        if orders is not None and c.all_rows and c.changed is None and not c.deleted:
            keys, values, nulls = _sorted_rows(self, orders, slot, keys, values, nulls)
        return _column_table(self._arrow_type, self._kind, keys, values, nulls, c.deleted)

    def image_keys(self, orders: KeyOrders, slot: Any) -> np.ndarray | None:
        """When the delta is the key group's full image of two or more int64 keys (the rows
        :meth:`to_table` sorts with ``orders``): its keys in ascending order, as the array
        ``orders`` keeps for ``slot``, which stays the very same object while the key group's
        keys do not change (an identity check then tells that they did not). Else ``None``."""
        c = self._captured
        if not (self.complete and c.all_rows and c.changed is None and not c.deleted
                and isinstance(c.keys, np.ndarray) and len(c.keys) >= 2):
            return None
        return self._sort(orders, slot)[1]

    def image(self, orders: KeyOrders | None = None, slot: Any = None) -> pa.Table | None:
        """The key group's full live state at the capture, when the capture copied it;
        ``orders``, ``slot``: as for :meth:`to_table`."""
        c = self._captured
        if not c.all_rows or not len(c.keys):
            return None
        keys, values, nulls = c.keys, self._values(), c.nulls
        if orders is not None:
            keys, values, nulls = _sorted_rows(self, orders, slot, keys, values, nulls)
        return _column_table(self._arrow_type, self._kind, keys, values, nulls, [])


def _sorted_rows(delta: ColumnDelta, orders: KeyOrders, slot: Any, keys: Any, values: Any,
                 nulls: np.ndarray | None) -> tuple:
    """A full image's rows (``delta``'s captured keys) in key order, when its keys are an int64
    array (else unchanged)."""
    if not isinstance(keys, np.ndarray) or len(keys) < 2:
        return keys, values, nulls
    order, ordered = delta._sort(orders, slot)
    values = values[order] if isinstance(values, np.ndarray) else [values[i] for i in order.tolist()]
    return ordered, values, None if nulls is None else nulls[order]


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
        values, self._ops = _split_deletes(values)
        self._blob = pickle.dumps(values, pickle.HIGHEST_PROTOCOL)
        self.complete = False

    def __getstate__(self) -> tuple:
        return self._kind, self._keys, self._blob, self._ops

    def __setstate__(self, state: tuple) -> None:
        self._kind, self._keys, self._blob, self._ops = state
        self.complete = False

    def to_table(self) -> pa.Table:
        key_arr, key_enc = _encode_keys(self._keys)
        value_arr = _pickled_values(pickle.loads(self._blob), self._ops)
        return _delta_table(self._kind, key_arr, key_enc, value_arr, b"pickle", self._ops, with_op=True)

    def image(self) -> None:
        """No full image: the capture froze only the changed entries."""
        return None


def _split_deletes(values: list) -> tuple[list, Any]:
    """``values`` with each ``_MISSING`` (a deleted key) as ``None``, and the op column: a list
    when there are deletes, else int8 zeros (zero-copy into Arrow)."""
    missing = _MISSING
    # identity only (a value's own __eq__ may be anything): a C-level scan
    if not any(map(operator.is_, values, itertools.repeat(missing))):
        return values, np.zeros(len(values), dtype=np.int8)
    ops = [OP_DELETE if v is missing else OP_UPSERT for v in values]
    return [None if v is missing else v for v in values], ops


def _pickled_values(values: list, ops: Any) -> pa.Array:
    """The binary value column of an untyped state: each value pickled on its own, null for
    a delete."""
    dumps = pickle.dumps
    if isinstance(ops, np.ndarray):  # all upserts
        blobs = [dumps(v, _PICKLE_PROTOCOL) for v in values]
    else:
        blobs = [None if o else dumps(v, _PICKLE_PROTOCOL) for v, o in zip(values, ops)]
    return pa.array(blobs, pa.binary())


def _column_table(t: pa.DataType | None, kind: str, keys: np.ndarray | list, values: np.ndarray | list,
                  nulls: np.ndarray | None, deleted: list) -> pa.Table:
    """A delta table from captured columns: upserts of ``keys``, then deletes of ``deleted``.
    ``t`` None: an untyped column, its values pickled one by one (the rows a dict key group
    of the same state would give)."""
    if t is None:
        value_arr, value_enc = _pickled_values(values, np.zeros(len(values), dtype=np.int8)), b"pickle"
    else:
        value_arr, value_enc = pa.array(values, t, mask=nulls), b"arrow"
    ops = np.zeros(len(values) + len(deleted), dtype=np.int8)
    if deleted:
        key_arr, key_enc = _encode_keys((keys.tolist() if isinstance(keys, np.ndarray) else list(keys)) + deleted)
        value_arr = pa.concat_arrays([value_arr, pa.nulls(len(deleted), value_arr.type)])
        ops[len(values):] = OP_DELETE
    elif isinstance(keys, np.ndarray):
        key_arr, key_enc = pa.array(keys, pa.int64()), b"arrow"
    else:
        key_arr, key_enc = _encode_keys(list(keys))
    return _delta_table(kind, key_arr, key_enc, value_arr, value_enc, ops, with_op=True)


class _StateSlot:
    """Storage of one declared state: per absolute key group a dict and a dirty set, or a
    :class:`~abs.columns.Column` (``typecode`` set; its dirty set stays empty)."""

    __slots__ = ("descriptor", "data", "dirty", "deleted", "handle", "arrow_type", "immutable_values", "typecode")

    def __init__(self, descriptor: StateDescriptor, backend: KeyedStateBackend) -> None:
        self.descriptor = descriptor
        self.arrow_type = descriptor.value_arrow_type()
        # values of these states are immutable Python objects (int, float, str, bytes, bool,
        # datetime...): holding references is as good as a copy, so their Arrow encoding can
        # move out of the synchronous part of a snapshot
        t = self.arrow_type
        self.immutable_values = (
            descriptor.kind in ("value", "reducing")
            and t is not None
            and (
                pa.types.is_integer(t)
                or pa.types.is_floating(t)
                or pa.types.is_boolean(t)
                or pa.types.is_string(t)
                or pa.types.is_large_string(t)
                or pa.types.is_binary(t)
                or pa.types.is_large_binary(t)
                or pa.types.is_temporal(t)
                or pa.types.is_decimal(t)
            )
        )
        # a value state of a fixed-width numeric type, or untyped, keeps its key groups as
        # columns (abs.columns): far cheaper snapshots, at about a dict's per-record cost for
        # updates (an insert costs more; see abs.columns)
        self.typecode = (OBJECTS if t is None else typecode_of(t)) if descriptor.kind == "value" else None
        self.data: list = [None] * backend.max_parallelism
        self.dirty: list = [None] * backend.max_parallelism
        for kg in backend.key_group_range:
            self.data[kg] = {} if self.typecode is None else Column(self.typecode)
            self.dirty[kg] = set()
        name = descriptor.name
        self.handle: _Handle
        if self.typecode is not None:
            self.handle = ColumnValueStateHandle(backend, name, self.data, self.dirty)
        elif isinstance(descriptor, ReducingState):
            self.handle = ReducingStateHandle(backend, name, self.data, self.dirty, descriptor.reduce_fn)
        else:
            handle_class = {"value": ValueStateHandle, "list": ListStateHandle, "map": MapStateHandle}
            self.handle = handle_class[descriptor.kind](backend, name, self.data, self.dirty)
        # key groups where a value/reducing-state key was deleted since the last capture: the
        # asynchronous encoding of the others needs no per-key existence check
        self.deleted: set = set()
        self.handle._deleted = self.deleted


def check_restore_table(table: pa.Table, declared_kind: str, where: str) -> None:
    """Refuse a table that cannot be restored into a state of ``declared_kind``: another
    state kind in its metadata, no ``key``/``value`` columns, or unresolved deletes."""
    meta = table.schema.metadata or {}
    kind = meta.get(META_STATE_KIND)
    if kind is not None and kind.decode() != declared_kind:
        raise StateError(
            f"{where}: the table holds {kind.decode()} state but the state is declared as "
            f"{declared_kind} state; restore into a state of the same kind (or migrate "
            "the snapshot offline)"
        )
    names = table.schema.names
    if "key" not in names or "value" not in names:
        raise StateError(f"{where}: table has columns {names}, needs 'key' and 'value'; "
                         "pass a table produced by capture (resolved)")
    if "op" in names and table.num_rows and pc.any(pc.not_equal(table.column("op"), OP_UPSERT)).as_py():
        raise StateError(
            f"{where}: the table contains deletes; resolve the chain (apply deltas in order) "
            "before restoring"
        )


class KeyedStateBackend:
    """In-memory keyed state of one operator subtask, with per-key-group dirty tracking.

    ``current_key`` / ``current_kg`` are plain attributes set by the runtime before user code
    runs for a record (see the module docstring for what is checked).
    """

    __slots__ = (
        "current_key",
        "current_kg",
        "operator_uid",
        "max_parallelism",
        "key_group_range",
        "_slots",
        "_pending",
        "_pending_deletes",
        "_last_captured",
        "_last_confirmed",
        "epoch",
        "_confirmed_epoch",
        "_capture_epochs",
    )

    def __init__(
        self,
        operator_uid: str,
        descriptors: Sequence[StateDescriptor],
        max_parallelism: int,
        key_group_range: KeyGroupRange,
    ) -> None:
        check_max_parallelism(max_parallelism)
        if not isinstance(key_group_range, KeyGroupRange) or key_group_range.end >= max_parallelism:
            raise ConfigError(
                f"operator {operator_uid!r}: key group range {key_group_range} is not a "
                f"KeyGroupRange within [0, {max_parallelism - 1}]; compute it with "
                "key_group_range(max_parallelism, parallelism, subtask)"
            )
        self.current_key: Any = None
        self.current_kg: Any = None
        self.operator_uid = operator_uid
        self.max_parallelism = max_parallelism
        self.key_group_range = key_group_range
        self._slots: dict[str, _StateSlot] = {}
        for d in descriptors:
            if not isinstance(d, tuple(_KINDS.values())):
                raise ConfigError(
                    f"operator {operator_uid!r}: {d!r} is not a state descriptor; declare "
                    "ValueState, ListState, MapState or ReducingState"
                )
            if d.name in self._slots:
                raise ConfigError(
                    f"operator {operator_uid!r}: state {d.name!r} is declared twice; give "
                    "each state its own name"
                )
            self._slots[d.name] = _StateSlot(d, self)
        # checkpoint id -> state name -> kg -> keys changed before that capture (and after
        # the previous one), for captures not yet confirmed; insertion order = id order.
        self._pending: dict[int, dict[str, dict[int, set]]] = {}
        # checkpoint id -> state name -> key groups with deletes in that capture's key sets
        self._pending_deletes: dict[int, dict[str, set[int]]] = {}
        self._last_captured: int | None = None
        self._last_confirmed: int | None = None
        # columnar states (abs.columns): writes stamp their slot with ``epoch``, which each
        # capture advances; a capture takes the slots stamped after the last confirmed
        # capture's epoch
        self.epoch = 1
        self._confirmed_epoch = 0
        self._capture_epochs: dict[int, int] = {}  # checkpoint id -> epoch it captured, unconfirmed

    # ------------------------------------------------------------------ introspection
    @property
    def descriptors(self) -> tuple[StateDescriptor, ...]:
        return tuple(s.descriptor for s in self._slots.values())

    @property
    def last_confirmed(self) -> int | None:
        """Highest confirmed checkpoint id (None before the first confirm)."""
        return self._last_confirmed

    @property
    def pending_captures(self) -> tuple[int, ...]:
        """Ids captured and neither confirmed nor aborted, ascending."""
        return tuple(self._pending)

    def state(self, name: str) -> Any:
        """The handle of state ``name`` (the same object on every call)."""
        return self._slot(name).handle

    def set_current_key(self, key: Any) -> None:
        """Checked alternative to the two attribute writes: computes and checks the key group."""
        kg = key_group(key, self.max_parallelism)
        if kg not in self.key_group_range:
            raise StateError(
                f"operator {self.operator_uid!r}: key {key!r} belongs to key group {kg}, outside "
                f"this subtask's range {self.key_group_range}; the record was routed to the "
                "wrong subtask (routing table and key-group range disagree)"
            )
        self.current_key = key
        self.current_kg = kg

    def _slot(self, name: str) -> _StateSlot:
        try:
            return self._slots[name]
        except KeyError:
            declared = ", ".join(map(repr, self._slots)) or "none"
            raise StateError(
                f"operator {self.operator_uid!r} has no state named {name!r} (declared: "
                f"{declared}); declare it in the operator's state=[...]"
            ) from None

    def _check_kg(self, kg: Any, what: str) -> None:
        if type(kg) is not int or kg not in self.key_group_range:
            raise StateError(
                f"operator {self.operator_uid!r}: {what} key group {kg!r} is outside this "
                f"subtask's range {self.key_group_range}; the record or call was routed to the "
                "wrong subtask"
            )

    def _check_current_kg(self, name: str) -> None:
        kg = self.current_kg
        if kg is None:
            raise StateError(
                f"operator {self.operator_uid!r}, state {name!r}: no current key is set; set "
                "backend.current_key and backend.current_kg before using state"
            )
        if isinstance(kg, int) and not isinstance(kg, bool) and kg in self.key_group_range:
            return  # the key group is fine: the caller re-raises the original error
        raise StateError(
            f"operator {self.operator_uid!r}, state {name!r}: current key group {kg!r} (key "
            f"{self.current_key!r}) is outside this subtask's range {self.key_group_range}; "
            "the record was routed to the wrong subtask"
        )

    # ------------------------------------------------------------------ bulk API
    def get_many(self, name: str, kg: int, keys: Iterable[Any]) -> list:
        """Values of ``keys`` (all in key group ``kg``) in state ``name``; None when absent.

        Returned objects are live (see the module docstring).
        """
        slot = self._slot(name)
        self._check_kg(kg, "get_many:")
        get = slot.data[kg].get
        return [get(k) for k in keys]

    def put_many(self, name: str, kg: int, keys: Sequence[Any], values: Sequence[Any]) -> None:
        """Set the values of ``keys`` (all in key group ``kg``) in state ``name``.

        Values are stored as given (for list and map states a list / dict; an empty or None one
        deletes the key). A reducing state's value is replaced, not folded.
        """
        slot = self._slot(name)
        self._check_kg(kg, "put_many:")
        if not isinstance(keys, list):
            keys = list(keys)
        if not isinstance(values, list):
            values = list(values)
        if len(keys) != len(values):
            raise StateError(
                f"operator {self.operator_uid!r}, state {name!r}: put_many got {len(keys)} keys "
                f"and {len(values)} values; pass one value per key"
            )
        d = slot.data[kg]
        if slot.typecode is not None:
            for k, v in zip(keys, values):
                self._column_set(slot, d, k, v, self.epoch)
            return
        if slot.descriptor.kind in ("list", "map"):
            for k, v in zip(keys, values):
                if v:
                    d[k] = v
                else:
                    d.pop(k, None)
        else:
            d.update(zip(keys, values))
        slot.dirty[kg].update(keys)

    def delete_many(self, name: str, kg: int, keys: Iterable[Any]) -> None:
        """Delete ``keys`` (all in key group ``kg``) from state ``name``."""
        slot = self._slot(name)
        self._check_kg(kg, "delete_many:")
        d = slot.data[kg]
        if slot.typecode is not None:
            slot.handle._forget()  # a delete moves a slot (see ColumnValueStateHandle)
            for k in keys:
                d.delete(k, self.epoch)
            return
        dirty = slot.dirty[kg]
        for k in keys:
            if d.pop(k, _MISSING) is not _MISSING:
                dirty.add(k)
                slot.deleted.add(kg)

    def items(self, name: str, kg: int | None = None) -> Iterator[tuple[Any, Any]]:
        """``(key, value)`` pairs of state ``name`` in key group ``kg`` (all key groups of the
        range when None). Do not modify the state while iterating."""
        slot = self._slot(name)
        if kg is not None:
            self._check_kg(kg, "items:")
            return iter(slot.data[kg].items())
        return (item for g in self.key_group_range for item in slot.data[g].items())

    # ------------------------------------------------------------------ snapshots
    def _check_capture_id(self, checkpoint_id: int) -> None:
        if type(checkpoint_id) is not int:
            raise StateError(
                f"operator {self.operator_uid!r}: checkpoint id {checkpoint_id!r} is not an int"
            )
        for last, what in ((self._last_captured, "captured"), (self._last_confirmed, "confirmed")):
            if last is not None and checkpoint_id <= last:
                raise StateError(
                    f"operator {self.operator_uid!r}: capture({checkpoint_id}) after checkpoint "
                    f"{last} was already {what}; checkpoint ids must increase (a runtime bug)"
                )

    def _take_dirty(self, checkpoint_id: int) -> None:
        """Move the current dirty sets into the pending record of ``checkpoint_id``."""
        self._check_capture_id(checkpoint_id)
        rng = range(self.key_group_range.start, self.key_group_range.end + 1)
        taken: dict[str, dict[int, set]] = {}
        for name, slot in self._slots.items():
            dirty = slot.dirty
            moved: dict[int, set] = {}
            for kg in [g for g in rng if dirty[g]]:
                moved[kg] = dirty[kg]
                dirty[kg] = set()
            taken[name] = moved
        self._pending[checkpoint_id] = taken
        self._pending_deletes[checkpoint_id] = {name: set(slot.deleted) for name, slot in self._slots.items()}
        for slot in self._slots.values():
            slot.deleted.clear()
        self._last_captured = checkpoint_id

    def _unconfirmed_key_sets(self, name: str) -> dict[int, list[set]]:
        """kg -> the sets of keys changed since the last confirmed checkpoint. The sets are
        never mutated again (capture swaps in fresh ones; abort builds new unions)."""
        by_kg: dict[int, list[set]] = {}
        for taken in self._pending.values():
            for kg, keys in taken[name].items():
                by_kg.setdefault(kg, []).append(keys)
        return by_kg

    def _unconfirmed_deletes(self, name: str) -> set[int]:
        """Key groups where a key of state ``name`` was deleted since the last confirmed checkpoint."""
        out: set[int] = set()
        for by_name in self._pending_deletes.values():
            out |= by_name.get(name, set())
        return out

    def _unconfirmed_keys(self, name: str) -> dict[int, Iterable[Any]]:
        """kg -> keys changed since the last confirmed checkpoint (read-only sets)."""
        by_kg = self._unconfirmed_key_sets(name)
        return {kg: sets[0] if len(sets) == 1 else set().union(*sets) for kg, sets in by_kg.items()}

    def capture(self, checkpoint_id: int, *, lazy: bool = False) -> dict[str, dict[int, Any]]:
        """Synchronous part of snapshot ``checkpoint_id``: state name -> key group -> delta.

        Only key groups with keys changed since the last confirmed checkpoint appear; every
        declared state name appears (possibly with an empty dict). Cost is proportional to the
        number of changed keys (plus a scan of the range's dirty sets).

        ``lazy``: for states whose values are immutable objects (typed value/reducing states
        of primitive Arrow types) only the changed keys and references to their values are
        taken now, and the delta is a :class:`PendingDelta` whose ``to_table()`` does the
        Arrow encoding later (the asynchronous part); for untyped states the values are frozen
        by one pickle of their list (:class:`PickledDelta`). Other states are encoded at once.
        Columnar key groups (value states of a fixed-width numeric type or untyped) always give
        a :class:`ColumnDelta` of copies (untyped values frozen by one pickle), encoded later.
        """
        self._take_dirty(checkpoint_id)
        since = self._advance_epoch(checkpoint_id)
        out: dict[str, dict[int, Any]] = {}
        for name, slot in self._slots.items():
            data = slot.data
            if slot.typecode is not None:
                out[name] = self._capture_columns(slot, since, lazy=lazy)
            elif lazy and slot.immutable_values:
                deleted = self._unconfirmed_deletes(name)
                out[name] = {
                    kg: PendingDelta(self, slot, kg, sets, data[kg], kg in deleted)
                    for kg, sets in sorted(self._unconfirmed_key_sets(name).items())
                }
            elif lazy and slot.arrow_type is None:
                kind = slot.descriptor.kind
                out[name] = {}
                for kg, keys in sorted(self._unconfirmed_keys(name).items()):
                    keys = list(keys)
                    get = data[kg].get
                    out[name][kg] = PickledDelta(kind, keys, list(map(get, keys, itertools.repeat(_MISSING))))
            else:
                changed = sorted(self._unconfirmed_keys(name).items())
                out[name] = {kg: self._encode(slot, kg, keys, data[kg], with_op=True) for kg, keys in changed}
        return out

    def capture_full(self, checkpoint_id: int) -> dict[str, dict[int, pa.Table]]:
        """Every non-empty key group's full contents as upserts (stop-the-world baseline).

        Counts as a capture for dirty tracking. Key groups without keys are omitted: a full
        capture is self-contained, an absent key group is empty.
        """
        self._take_dirty(checkpoint_id)
        self._advance_epoch(checkpoint_id)
        out: dict[str, dict[int, pa.Table]] = {}
        for name, slot in self._slots.items():
            data = slot.data
            if slot.typecode is not None:
                out[name] = self._capture_columns(slot, 0, lazy=False, full=True)
                continue
            out[name] = {
                kg: self._encode(slot, kg, data[kg], data[kg], with_op=True)
                for kg in self.key_group_range
                if data[kg]
            }
        return out

    def confirm(self, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` completed: forget the changes captured by every
        checkpoint ``<= checkpoint_id``. Out-of-order or repeated confirmations are harmless."""
        if self._last_confirmed is not None and checkpoint_id <= self._last_confirmed:
            return
        for cid in [c for c in self._pending if c <= checkpoint_id]:
            del self._pending[cid]
            self._pending_deletes.pop(cid, None)
        self._last_confirmed = checkpoint_id
        epochs = [e for c, e in self._capture_epochs.items() if c <= checkpoint_id]
        if epochs:
            self._confirmed_epoch = max(self._confirmed_epoch, *epochs)
            self._capture_epochs = {c: e for c, e in self._capture_epochs.items() if c > checkpoint_id}
            for slot in self._slots.values():
                if slot.typecode is not None:
                    for kg in self.key_group_range:
                        slot.data[kg].forget_deletes(self._confirmed_epoch)

    def abort(self, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` will never complete: nothing is forgotten.

        Its captured changes are folded into the next pending capture (which already contains
        them) or, if there is none, back into the dirty sets. Unknown ids are ignored.
        """
        self._capture_epochs.pop(checkpoint_id, None)  # columnar states: their stamps stay newer
        taken = self._pending.pop(checkpoint_id, None)
        if taken is None:
            return
        later = next((c for c in self._pending if c > checkpoint_id), None)
        for name, kgs in self._pending_deletes.pop(checkpoint_id, {}).items():
            if later is not None:
                self._pending_deletes.setdefault(later, {}).setdefault(name, set()).update(kgs)
            else:
                self._slots[name].deleted.update(kgs)
        for name, by_kg in taken.items():
            if later is not None:
                target = self._pending[later][name]
                for kg, keys in by_kg.items():
                    if kg in target:
                        target[kg] = target[kg] | keys
                    else:
                        target[kg] = keys
            else:
                dirty = self._slots[name].dirty
                for kg, keys in by_kg.items():
                    dirty[kg].update(keys)

    # ------------------------------------------------------------------ columnar states
    def _advance_epoch(self, checkpoint_id: int) -> int:
        """Close the current epoch for capture ``checkpoint_id``; returns the epoch of the last
        confirmed capture (slots stamped after it changed since)."""
        self._capture_epochs[checkpoint_id] = self.epoch
        self.epoch += 1
        return self._confirmed_epoch

    def _capture_columns(self, slot: _StateSlot, since: int, *, lazy: bool, full: bool = False) -> dict[int, Any]:
        out: dict[int, Any] = {}
        for kg in self.key_group_range:
            captured = slot.data[kg].capture(since, full=full)
            if captured is not None:
                delta = ColumnDelta(captured, slot.arrow_type, slot.descriptor.kind)
                out[kg] = delta if lazy else delta.to_table()
        return out

    def _column_set(self, slot: _StateSlot, col: Column, key: Any, value: Any, epoch: int) -> None:
        try:
            col.set(key, value, epoch)
        except (TypeError, OverflowError) as exc:
            if not _hashable(key):
                raise
            raise StateError(
                f"operator {self.operator_uid!r}, state {slot.descriptor.name!r}: value {value!r} of key "
                f"{key!r} does not fit the declared Arrow type {slot.arrow_type} ({exc}); write values "
                "of that type or declare the state without a type (pickled)"
            ) from exc

    # ------------------------------------------------------------------ encoding
    def _encode(self, slot: _StateSlot, kg: int, keys: Iterable[Any], d: dict, *, with_op: bool) -> pa.Table:
        keys = list(keys)
        get = d.get
        return self._encode_pairs(slot, kg, keys, list(map(get, keys, itertools.repeat(_MISSING))), with_op=with_op)

    def _encode_pairs(self, slot: _StateSlot, kg: int, keys: list, values: list, *, with_op: bool,
                      deletes: bool | None = None) -> pa.Table:
        """Encode keys and their values (``_MISSING``: deleted) as a delta table.
        ``deletes=False``: the caller knows no value is ``_MISSING``."""
        if deletes is False:
            ops: Any = np.zeros(len(values), dtype=np.int8)  # all upserts (zero-copy into Arrow)
        else:
            values, ops = _split_deletes(values)
        key_arr, key_enc = _encode_keys(keys)
        value_arr, value_enc = self._encode_values(slot, kg, keys, values, ops)
        return _delta_table(slot.descriptor.kind, key_arr, key_enc, value_arr, value_enc, ops, with_op=with_op)

    def _encode_values(self, slot: _StateSlot, kg: int, keys: list, values: list, ops: list) -> tuple[pa.Array, bytes]:
        t = slot.arrow_type
        if t is None:
            return _pickled_values(values, ops), b"pickle"
        if slot.descriptor.kind == "map":
            values = [None if v is None else list(v.items()) for v in values]
        try:
            return pa.array(values, t), b"arrow"
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError, ValueError) as exc:
            bad_key, bad_value = _first_unconvertible(keys, values, t)
            raise StateError(
                f"operator {self.operator_uid!r}, state {slot.descriptor.name!r}, key group "
                f"{kg}: value {bad_value!r} of key {bad_key!r} does not fit the declared Arrow "
                f"type {t} ({exc}); write values of that type or declare the state without a "
                "type (pickled)"
            ) from exc

    # ------------------------------------------------------------------ restore
    def restore(self, state_name: str, kg: int, table: pa.Table, *, verify: bool = False) -> None:
        """Load a resolved table (``key``, ``value``; no ``op`` column or only upserts) of key
        group ``kg`` into state ``state_name``, decoding per the schema metadata. Entries are
        upserted into what is there; restored keys are not dirty. ``verify=True`` also checks
        that every key hashes to ``kg``."""
        slot = self._slot(state_name)
        self._check_kg(kg, "restore:")
        where = f"operator {self.operator_uid!r}, state {state_name!r}, key group {kg}"
        meta = table.schema.metadata or {}
        check_restore_table(table, slot.descriptor.kind, where)
        if slot.typecode is not None and not verify and self._load_column(slot, kg, table, meta):
            return
        keys = _decode(table.column("key"), meta.get(META_KEY_ENCODING), where, "key")
        values = _decode(table.column("value"), meta.get(META_VALUE_ENCODING), where, "value")
        kind_name = slot.descriptor.kind
        if kind_name == "map":
            values = [None if v is None else dict(v) for v in values]
        if verify:
            m = self.max_parallelism
            for k in keys:
                if key_group(k, m) != kg:
                    raise StateError(
                        f"{where}: key {k!r} belongs to key group {key_group(k, m)}; the "
                        "snapshot file is in the wrong key group (corrupt or re-keyed with "
                        "another max_parallelism)"
                    )
        d = slot.data[kg]
        if slot.typecode == OBJECTS and d.load(keys, values, None):
            return
        if slot.typecode is not None:
            for k, v in zip(keys, values):
                self._column_set(slot, d, k, v, 0)  # epoch 0: not dirty
        elif kind_name in ("list", "map"):
            for k, v in zip(keys, values):
                if v:
                    d[k] = v
        else:
            d.update(zip(keys, values))

    def _load_column(self, slot: _StateSlot, kg: int, table: pa.Table, meta: dict) -> bool:
        """Bulk-load an Arrow-encoded table with integer keys into an empty column; False when
        the table or the column is not of that shape (the caller loads it key by key)."""
        if meta.get(META_KEY_ENCODING) != b"arrow" or meta.get(META_VALUE_ENCODING) != b"arrow":
            return False
        key_col, value_col = table.column("key"), table.column("value")
        if not pa.types.is_integer(key_col.type) or key_col.null_count:
            return False
        try:
            keys = key_col.cast(pa.int64()).to_numpy()
            values = value_col.cast(slot.arrow_type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
            return False  # the key by key path names the value that does not fit
        nulls = values.is_null().to_numpy() if values.null_count else None
        if values.null_count:
            values = values.fill_null(0)
        return slot.data[kg].load(keys, values.to_numpy(), nulls)


# ----------------------------------------------------------------------------- codecs


def _delta_table(kind: str, key_arr: pa.Array, key_enc: bytes, value_arr: pa.Array, value_enc: bytes,
                 ops: Any, *, with_op: bool) -> pa.Table:
    fields = [pa.field("key", key_arr.type), pa.field("value", value_arr.type)]
    arrays = [key_arr, value_arr]
    if with_op:
        fields.append(pa.field("op", pa.int8(), nullable=False))
        arrays.append(pa.array(ops, pa.int8()))
    schema = pa.schema(
        fields,
        metadata={META_KEY_ENCODING: key_enc, META_VALUE_ENCODING: value_enc, META_STATE_KIND: kind.encode()},
    )
    return pa.Table.from_arrays(arrays, schema=schema)


def _encode_keys(keys: list) -> tuple[pa.Array, bytes]:
    types = set(map(type, keys))
    if len(types) == 1:
        (only,) = types
        arrow_type = {int: pa.int64(), str: pa.string(), bytes: pa.binary()}.get(only)
        if arrow_type is not None:
            try:
                return pa.array(keys, arrow_type), b"arrow"
            except (OverflowError, pa.ArrowInvalid, pa.ArrowTypeError, UnicodeEncodeError):
                pass  # ints beyond int64, lone surrogates: pickle below
    dumps = pickle.dumps
    return pa.array([dumps(k, _PICKLE_PROTOCOL) for k in keys], pa.binary()), b"pickle"


def _decode(column: pa.ChunkedArray, encoding: bytes | None, where: str, what: str) -> list:
    if encoding == b"arrow":
        return column.to_pylist()
    if encoding == b"pickle":
        loads = pickle.loads
        return [None if b is None else loads(b) for b in column.to_pylist()]
    raise StateError(
        f"{where}: {what} column has encoding {encoding!r} in the schema metadata "
        f"({META_KEY_ENCODING.decode()}/{META_VALUE_ENCODING.decode()} must be 'arrow' or "
        "'pickle'); the file was not written by this version of abs or is corrupt"
    )


def _first_unconvertible(keys: list, values: list, t: pa.DataType) -> tuple[Any, Any]:
    for k, v in zip(keys, values):
        try:
            pa.array([v], t)
        except Exception:  # noqa: BLE001 - only locating the culprit for the message
            return k, v
    return None, None
