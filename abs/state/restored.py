"""Restored columnar key groups, made usable on first use.

Restoring a key group of a typed value state (:class:`~abs.columns.Column`) used to build its
Python objects at once: a ``str`` (or ``int``) per key, a ``dict`` of every key to its slot.
For string keys that is most of a restore's time (5 M keys: about 2 s of CPU in one worker,
where pyarrow decodes the same files in a tenth of it), and the first record waited for all of
it. Now the restore decodes and checks a key group's table with Arrow and numpy only, and keeps
it as a :class:`RestoredColumn`: the key column (Arrow; integer keys as a numpy array), the
values cast to the state's type (numpy) and their null mask. The first use of the key group
(a record of one of its keys, a bulk read or write, a full capture, a handover) builds the
column's Python objects from these arrays, once, and the object becomes a plain
:class:`~abs.columns.Column` again (its class is switched in place, so nothing that holds it
sees a change, and the hot path pays nothing once it is built). A record therefore waits only
for its own key group, and key groups no record touches cost no Python objects at all.

Until it is built, a restored key group answers without building: its length, and an
incremental capture (restored keys are not dirty, and nothing can have changed a key group
nobody used: ``None``). Everything else builds it first: the column's lazy slots (``index``,
``keys``, ``values``, ``stamps``, ``nulls``) are unset while it waits, reading one ends in
:meth:`RestoredColumn.__getattr__` and writing one in :meth:`RestoredColumn.__setattr__`; a
copy or a pickle is of the built column.

Errors a restore must report (a value that does not fit the declared type) are found before
a key group is kept this way; duplicate keys (a resolved chain has none) make the build
insert key by key, the last value winning, as the eager restore did.
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pyarrow as pa

from abs.columns import Captured, Column

from .encoding import arrow_to_list

__all__ = ["RestoredColumn"]

_LAZY = frozenset(("index", "keys", "values", "stamps", "nulls"))
_BUILD = threading.Lock()  # a key group is built once, whichever thread uses it first


class RestoredColumn(Column):
    """A restored key group not used yet (see the module docstring). Make one with
    :meth:`keep`; it turns itself into a :class:`~abs.columns.Column` on first use."""

    __slots__ = ()

    @classmethod
    def keep(cls, col: Column, keys: pa.Array | pa.ChunkedArray | np.ndarray, values: np.ndarray,
             nulls: np.ndarray | None) -> None:
        """Turn the empty column ``col`` into a restored key group of unique ``keys`` (text
        keys as an Arrow array, integer keys as int64 numpy), ``values`` (numpy, of the
        column's dtype) and ``nulls`` (a bool mask, or None), stamped 0 (not dirty) when built."""
        if len(col.index) or col.deleted:
            raise ValueError("RestoredColumn.keep needs an empty column; restore into a fresh key group")
        if len(keys) != len(values):
            raise ValueError(f"RestoredColumn.keep: {len(keys)} keys and {len(values)} values; pass one value per key")
        typecode = None if col.objects else col.values.typecode
        col.__class__ = cls
        for name in _LAZY:
            delattr(col, name)
        col.image = (keys, values, nulls, typecode)

    def __getattr__(self, name: str) -> Any:
        # only reached for an attribute normally absent: a lazy slot while the key group waits
        if name in _LAZY:
            self.build()
            return object.__getattribute__(self, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def build(self) -> None:
        """Build the key group's Python objects (keys, the key index, the values array) and
        become a plain :class:`~abs.columns.Column`."""
        with _BUILD:
            if type(self) is not RestoredColumn:
                return  # another thread built it
            keys, values, nulls, typecode = self.image
            built = Column(typecode)
            keys = keys if isinstance(keys, np.ndarray) else arrow_to_list(keys)
            if not built.load(keys, values, nulls):  # repeated keys: the last one wins
                dead = set() if nulls is None else set(np.flatnonzero(nulls).tolist())
                for i, (k, v) in enumerate(zip(keys.tolist() if isinstance(keys, np.ndarray) else keys,
                                               values.tolist())):
                    built.set(k, None if i in dead else v, 0)
            # each part set whole (a thread reading one sees it built, or builds and waits
            # here), the index last; this class's __setattr__ would build again
            for name in ("keys", "values", "stamps", "nulls", "index"):
                object.__setattr__(self, name, getattr(built, name))
            self.__class__ = Column
            self.image = None

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _LAZY:
            self.build()  # a write to one part of the key group must not lose the others
        object.__setattr__(self, name, value)

    def __reduce_ex__(self, protocol: Any) -> Any:
        self.build()  # a copy or a pickle is of the built column
        return self.__reduce_ex__(protocol)

    def __len__(self) -> int:
        return len(self.image[0])

    def capture(self, since: int, *, full: bool = False) -> Captured | None:
        if not full:
            return None  # restored keys are not dirty, and an unused key group has no other
        self.build()
        return Column.capture(self, since, full=full)
