"""State handles: the objects user code gets (``ctx.state.<name>``), scoped to the backend's
current key.

Hot path. Before calling user code for a record, the runtime sets the current key with two
plain attribute writes on the backend (``backend.current_key``, ``backend.current_kg``); each
handle call reads those two attributes and indexes the per-key-group list of its state (see
:mod:`abs.state` for what is checked, and when).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

from abscore.native import NATIVE

from .encoding import MISSING
from .restored import RestoredColumn

__all__ = [
    "ValueStateHandle",
    "ColumnValueStateHandle",
    "PyColumnValueStateHandle",
    "ListStateHandle",
    "MapStateHandle",
    "ReducingStateHandle",
]

# Hot path. Each handle holds the backend and the two per-key-group lists of its state
# (``_data[kg]``: dict key -> value, ``_dirty[kg]``: set of changed keys). A lookup error
# (None slot, index past the end, unset kg) is turned into a StateError by ``_fail``, which
# re-raises the original exception when the key group is fine (unhashable key, an error in
# a reduce function...).


class StateHandle:
    __slots__ = ("_backend", "_data", "_dirty", "_deleted", "name")

    def __init__(self, backend: Any, name: str, data: list, dirty: list) -> None:
        # backend: the KeyedStateBackend (not imported: it imports this module)
        self._backend = backend
        self._data = data
        self._dirty = dirty
        self._deleted: set = set()  # replaced by its slot's set: key groups with a delete since the last capture
        self.name = name

    def _fail(self) -> None:
        self._backend._check_current_kg(self.name)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._backend.operator_uid}/{self.name}>"


class ValueStateHandle(StateHandle):
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
            if self._data[kg].pop(key, MISSING) is not MISSING:
                self._dirty[kg].add(key)
                self._deleted.add(kg)
        except (TypeError, AttributeError, IndexError):
            self._fail()
            raise


class _ColumnValueMethods:
    """What :class:`ColumnValueStateHandle` and :class:`PyColumnValueStateHandle` share: all but
    the fields (a base class gives those) and the fast ``value``/``update``."""

    __slots__ = ()

    def __init__(self, backend: Any, name: str, data: list, dirty: list) -> None:
        StateHandle.__init__(self, backend, name, data, dirty)  # type: ignore[arg-type]  # the same fields
        self._forget()

    _fail = StateHandle._fail
    __repr__ = StateHandle.__repr__

    def _forget(self) -> None:
        self._hit_key: Any = MISSING
        self._hit_col: Any = None
        self._hit_slot = -1

    def _value_slow(self) -> Any:
        """:meth:`value` in Python (the C ``value`` calls it for whatever it does not expect)."""
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

    def _update_by_lookup(self, value: Any) -> None:
        """:meth:`update` without a remembered slot: one lookup."""
        b = self._backend
        key = b.current_key
        try:
            col = self._data[b.current_kg]
            if type(col) is RestoredColumn:
                col.set(key, value, b.epoch)  # probed, a new key appended (or built first)
                return
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


class _PyValueFields:
    __slots__ = ("_backend", "_data", "_dirty", "_deleted", "name", "_hit_key", "_hit_col", "_hit_slot")


class PyColumnValueStateHandle(_ColumnValueMethods, _PyValueFields):
    """:class:`ColumnValueStateHandle` in Python alone: what runs where the C module is not
    built (:mod:`abscore.native`), and what the tests hold the C one against."""

    __slots__ = ()

    value = _ColumnValueMethods._value_slow

    def update(self, value: Any) -> None:
        """Set the value of the current key (None is stored as a value; use clear())."""
        b = self._backend
        if b.current_key is self._hit_key:  # the slot value() found: a read-modify-write
            col = self._hit_col
            if not col.nulls:
                i = self._hit_slot
                try:
                    col.values[i] = value
                except (TypeError, OverflowError):
                    pass  # nothing changed; the checked path below names the problem
                else:
                    col.stamps[i] = b.epoch
                    return
        self._update_by_lookup(value)


if NATIVE is not None:

    class ColumnValueStateHandle(_ColumnValueMethods, NATIVE.ValueHandle):
        """Handle of a :class:`ValueState` of a fixed-width numeric type, or untyped, kept in
        :class:`~abs.columns.Column` key groups (``_data[kg]``). Same API as
        :class:`ValueStateHandle`; a value the declared type cannot hold is refused at once.

        :meth:`value` remembers where it found the current key (the key object, its column and
        slot), so the :meth:`update` of a read-modify-write, which nearly every process function
        does, writes there without a second lookup when the current key is the same object.
        Only a delete moves a slot (the last one into the hole), so :meth:`clear` and the
        backend's bulk deletes and restores forget the remembered slot (:meth:`_forget`); and
        the build of a probed restored key group with deletes, which renumbers its slots
        (:mod:`abs.state.restored`), so a slot found in a probed key group is written only
        while it stays probed.

        ``value`` and ``update`` are C (``abscore._native.ValueHandle``: two method calls of a
        read-modify-write cost ~1/3 of their Python twins, :class:`PyColumnValueStateHandle`);
        whatever they do not expect they hand to the Python code here, which gives the same
        result or names the error."""

        __slots__ = ()

else:
    ColumnValueStateHandle = PyColumnValueStateHandle  # type: ignore[misc,assignment]


class ListStateHandle(StateHandle):
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
            elif d.pop(key, MISSING) is MISSING:
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
            if self._data[kg].pop(key, MISSING) is not MISSING:
                self._dirty[kg].add(key)
                self._deleted.add(kg)
        except (TypeError, AttributeError, IndexError):
            self._fail()
            raise


_EMPTY: dict = {}


class MapStateHandle(StateHandle):
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
            if m is None or m.pop(map_key, MISSING) is MISSING:
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
            if self._data[kg].pop(key, MISSING) is not MISSING:
                self._dirty[kg].add(key)
        except (TypeError, AttributeError, IndexError):
            self._fail()
            raise


class ReducingStateHandle(StateHandle):
    """Handle of a :class:`ReducingState` scoped to the backend's current key."""

    __slots__ = ("_fn",)

    def __init__(self, backend: Any, name: str, data: list, dirty: list, fn: Callable) -> None:
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
            acc = d.get(key, MISSING)
            d[key] = value if acc is MISSING else self._fn(acc, value)
            self._dirty[kg].add(key)
        except (TypeError, AttributeError, IndexError):
            self._fail()
            raise

    def clear(self) -> None:
        b = self._backend
        kg = b.current_kg
        key = b.current_key
        try:
            if self._data[kg].pop(key, MISSING) is not MISSING:
                self._dirty[kg].add(key)
        except (TypeError, AttributeError, IndexError):
            self._fail()
            raise

