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
nobody used: ``None``); a record's read, a delete and a full capture probe it (below).
Everything else builds it first: the column's lazy slots (``index``,
``keys``, ``values``, ``stamps``, ``nulls``) are unset while it waits, reading one ends in
:meth:`RestoredColumn.__getattr__` and writing one in :meth:`RestoredColumn.__setattr__`; a
copy or a pickle is of the built column.

**Probed key groups.** The keys need not be built at all for what nearly every record does,
a read-modify-write of a key the key group holds. On its first ``value()`` through a typed
ValueState's C handle (:mod:`abs.state.handles`), a key group is *probed* instead
(:meth:`RestoredColumn._probe`): an index over its restored keys, the Arrow ``str``/``bytes``
keys or the int64 array (``abscore._native.RestoredIndex``: a table of hash tags and rows,
the key compared on a hit, 5-11 bytes a key) replaces the ``dict``, and the nulls become the
column's own as a built key group has them. Its values are read from the restored array
(which the index keeps) until its first write, which copies them into the column's own array
and makes its stamps: a key group only read makes neither (together 16 bytes a key of fresh
memory, more than the index). The handle then
reads and writes the slot the index finds, stamping it as a built column does, so an
incremental capture takes the changed rows, their keys cut from the restored array (no
Python object made). A new key is appended as a built column appends it, the index keeping
it beside the restored ones (``add``: a dict of the keys added since, looked up after the
table; :meth:`RestoredColumn.set`), so a key group stays probed while its keys only grow. A
full capture (a savepoint, a handover) takes every row the same way, probing a key group
nobody used first (its index also finds repeated keys, which build it instead). A delete
(:meth:`RestoredColumn.delete`, probing a key group nobody used first) marks the key's slot
dead in the index (``kill``: a bit a slot, restored or added, in a bitmap made on the first
delete) and notes the key in ``deleted`` as a built column does; no slot moves. The index
then finds the key no more (a read gives ``None``) and takes it again as an added key when
it is written again (which drops it from ``deleted``); the length and the captures leave
the dead slots out, a capture giving the deletes as :meth:`Column.capture` does, and a build
keeps the live slots alone, renumbered (so the C handle writes a slot its ``value()`` found
in a probed key group only while that stays probed). Deleting 1 % of 5 M restored string
keys (``scripts/bench_recovery.py --reference``, every key group touched): 0.06 s and 1.7 MB
(the bitmaps, ``deleted``), every key group still probed, where building them took 0.76 s
and ~500 MB. A bulk
read or write, ``items``, anything else on the Python path (no C module, nulls in the
column, a key not of the index's exact type, such as a ``bool`` or a ``float``) builds the
key group as above, keeping what was written. 5 M string keys
(``scripts/bench_recovery.py --reference``): the first use of every key group 0.085 s instead
of 0.76 s, a read-modify-write of a restored key 0.5 us instead of 0.9 us (a dict of 5 M strings
misses the caches; the index is a few hundred KB a key group, 4-byte entries), and no ~100 bytes of Python
objects a key until a key group is built.

Errors a restore must report (a value that does not fit the declared type) are found before
a key group is kept this way; duplicate keys (a resolved chain has none) make the build
insert key by key, the last value winning, as the eager restore did.
"""
from __future__ import annotations

import threading
from typing import Any

from array import array

import numpy as np
import pyarrow as pa

from abs.columns import _IMAGE_SHARE, Captured, Column, _slots
from abscore.native import NATIVE

from .encoding import arrow_to_list

__all__ = ["RestoredColumn"]

_LAZY = frozenset(("index", "keys", "values", "stamps", "nulls"))
_INDEX = None if NATIVE is None else NATIVE.RestoredIndex
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
        # only reached for an attribute normally absent: a lazy slot while the key group waits,
        # or the stamps or values of a probed key group nothing has written to yet
        if name in ("stamps", "values"):
            with _BUILD:
                if type(self) is RestoredColumn and _INDEX is not None and isinstance(self.image, _INDEX):
                    return self._stamped() if name == "stamps" else self._copied()
        if name in _LAZY:
            self.build()
            return object.__getattribute__(self, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _stamped(self) -> array:
        """The stamps of a probed key group (``_BUILD`` held), made on the first write: a key
        group only read never pays for them (8 bytes a key of fresh memory: 0.04 s at 5 M
        keys, a third of what their index took), and until it is written nothing in it changed."""
        try:
            return object.__getattribute__(self, "stamps")
        except AttributeError:
            stamps = array("q", bytes(8 * len(self.image)))  # every slot's, added keys' too: 0
            object.__setattr__(self, "stamps", stamps)
            return stamps

    def _copied(self) -> array:
        """The values array of a probed key group (``_BUILD`` held), copied from the restored
        values its index kept (:meth:`_probe`) when first needed: a write, the Python path, a
        build. Until then the C ``value()`` reads the restored values themselves."""
        try:
            return object.__getattribute__(self, "values")
        except AttributeError:
            index = self.image
            built = array(index.kept_typecode)
            built.frombytes(memoryview(index.kept_values).cast("B"))
            object.__setattr__(self, "values", built)  # first: a reader sees the copy, or the kept values
            index.drop_values()
            return built

    def _values_np(self) -> np.ndarray:
        """The key group's values as numpy, its own or the restored ones its index kept."""
        try:
            return np.frombuffer(object.__getattribute__(self, "values"), dtype=self.dtype)
        except AttributeError:
            index = self.image
            return np.frombuffer(index.kept_values, dtype=self.dtype)[:len(index)]  # no write: no added key

    def _probe(self) -> bool:
        """Make the key group answer the C ``value()``/``update()`` of a typed ValueState's
        handle (:mod:`abs.state.handles`) from an index over its Arrow text keys or int64 keys
        (the *probed* state, see the module docstring): its nulls as a built column holds them,
        its values read from the restored array until the first write, no Python object per
        key. False where that cannot be (an untyped
        state, repeated keys, no C module): the caller builds it instead."""
        with _BUILD:
            if type(self) is not RestoredColumn:
                return False  # another thread built it
            image = self.image
            if _INDEX is not None and isinstance(image, _INDEX):
                return True
            keys, values, nulls, typecode = image
            if isinstance(keys, pa.ChunkedArray):  # a table's column: one chunk as a rule
                keys = keys.chunk(0) if keys.num_chunks == 1 else keys.combine_chunks()
            if _INDEX is None or typecode is None:
                return False
            if isinstance(keys, np.ndarray):
                index = NATIVE.int_index(np.ascontiguousarray(keys, dtype=np.int64))
            elif isinstance(keys, pa.Array) and (pa.types.is_string(keys.type) or pa.types.is_binary(keys.type)) \
                    and not keys.null_count:
                buffers = keys.buffers()
                index = NATIVE.text_index(keys, buffers[1], buffers[2], keys.offset, len(keys),
                                          pa.types.is_binary(keys.type))
            else:
                return False
            if index is None:
                return False  # repeated keys: the build inserts key by key
            # each part set whole, the index last (a thread sees the key group probed only
            # once it has every part); this class's __setattr__ would build. The values stay
            # the restored ones, read through the index, until the first write copies them
            # (_copied); the stamps are made then too (_stamped).
            index.keep_values(np.ascontiguousarray(values, dtype=self.dtype), typecode)
            object.__setattr__(self, "nulls", set(np.flatnonzero(nulls).tolist()) if nulls is not None else set())
            self.image = index
            return True

    def build(self) -> None:
        """Build the key group's Python objects (keys, the key index, the values array) and
        become a plain :class:`~abs.columns.Column`."""
        with _BUILD:
            if type(self) is not RestoredColumn:
                return  # another thread built it
            image = self.image
            if _INDEX is not None and isinstance(image, _INDEX):
                # probed: the values, stamps and nulls are the key group's (written since);
                # the keys in the index's order, which is their slots', but for those deleted
                # (their slots dead: the live ones renumbered, _compact)
                self._copied()
                self._stamped()
                extra = image.extra_keys or []
                if image.killed:
                    self._compact(image)
                else:
                    if isinstance(image.keys, np.ndarray):
                        keys = image.keys.tolist() + extra
                        object.__setattr__(self, "keys", array("q", keys))
                    else:
                        keys = arrow_to_list(image.keys) + extra
                        object.__setattr__(self, "keys", keys)
                    object.__setattr__(self, "index", dict(zip(keys, _slots(len(keys)))))
                self.__class__ = Column
                self.image = None
                return
            keys, values, nulls, typecode = image
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

    def _compact(self, index: Any) -> None:
        """The built parts of a probed key group with deletes (``_BUILD`` held, values and
        stamps its own): its live slots alone, renumbered in order, as a built column holds
        them; ``deleted`` stays. The keys, values, stamps and nulls set whole, the ``dict``
        last, as :meth:`build` does."""
        live = np.flatnonzero(~_dead_mask(index))
        kept = _keys_of(index, live)
        keys: Any
        if isinstance(kept, np.ndarray):
            listed = kept.tolist()
            keys = array("q", kept.tobytes())
        else:
            listed = keys = arrow_to_list(kept)
        values = object.__getattribute__(self, "values")
        built = array(values.typecode)
        built.frombytes(np.frombuffer(values, dtype=self.dtype)[live].tobytes())
        stamps = array("q", np.frombuffer(object.__getattribute__(self, "stamps"), dtype=np.int64)[live].tobytes())
        nulls = object.__getattribute__(self, "nulls")
        if nulls:  # no dead slot among them (a delete drops its slot's)
            nulls = set(np.searchsorted(live, np.fromiter(nulls, dtype=np.int64, count=len(nulls))).tolist())
        for name, part in (("keys", keys), ("values", built), ("stamps", stamps), ("nulls", set(nulls))):
            object.__setattr__(self, name, part)
        object.__setattr__(self, "index", dict(zip(listed, _slots(len(listed)))))

    def items(self) -> Any:
        """:meth:`Column.items` of the built key group: built before it takes the values and
        nulls (a build with deletes renumbers the slots: see :meth:`_compact`)."""
        self.build()
        return Column.items(self)

    def delete(self, key: Any, epoch: int) -> bool:
        """:meth:`Column.delete`: remove ``key``, False when it was absent. A probed key group
        (one nobody used is probed first) marks the key's slot dead in its index instead of
        being built; its slots do not move. A key the index cannot answer for builds it."""
        index = self.image
        probed = _INDEX is not None and isinstance(index, _INDEX)
        if not probed and self._probe():
            index, probed = self.image, True
        at = index.find(key) if probed else -2
        if at == -2:
            self.build()
            return Column.delete(self, key, epoch)
        if at == -1:
            return False
        index.kill(at)
        nulls = self.nulls
        if nulls:
            nulls.discard(at)
        self.deleted[key] = epoch
        return True

    def set(self, key: Any, value: Any, epoch: int) -> None:
        """:meth:`Column.set`; a probed key group writes a key its index holds in place and
        appends a new one (the index takes it, a deleted key too), without being built."""
        index = self.image
        at = index.find(key) if _INDEX is not None and isinstance(index, _INDEX) else -2
        if at == -2:
            self.build()
            Column.set(self, key, value, epoch)
            return
        values, nulls, stamps = self.values, self.nulls, self.stamps  # the stamps: as many as values
        if at >= 0:
            values[at] = 0 if value is None else value  # TypeError, OverflowError: nothing changed
            stamps[at] = epoch
            if value is None:
                nulls.add(at)
            elif nulls:
                nulls.discard(at)
            return
        values.append(0 if value is None else value)  # as above
        try:
            took = index.add(key)
        except BaseException:
            values.pop()
            raise
        if not took:  # a key the index does not take: the built dict does
            values.pop()
            self.build()
            Column.set(self, key, value, epoch)
            return
        stamps.append(epoch)
        if self.deleted:
            self.deleted.pop(key, None)  # deleted, then written again: as Column.insert does
        if value is None:
            nulls.add(len(values) - 1)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _LAZY:
            self.build()  # a write to one part of the key group must not lose the others
        object.__setattr__(self, name, value)

    def __reduce_ex__(self, protocol: Any) -> Any:
        self.build()  # a copy or a pickle is of the built column
        return self.__reduce_ex__(protocol)

    def __len__(self) -> int:
        image = self.image
        return len(image) - image.killed if _INDEX is not None and isinstance(image, _INDEX) else len(image[0])

    def capture(self, since: int, *, full: bool = False) -> Captured | None:
        index = self.image
        probed = _INDEX is not None and isinstance(index, _INDEX)
        if full and not probed:
            # a savepoint's or a handover's full image of a key group nobody used: from its
            # index (which finds repeated keys) rather than its Python objects
            if not self._probe():
                self.build()
                return Column.capture(self, since, full=full)
            index, probed = self.image, True
        if not probed:
            return None  # restored keys are not dirty, and an unused key group has no other
        # probed: the handle wrote values of restored keys in place (anything else built it),
        # a delete marked its slot dead; the changed live rows, their keys taken from the
        # restored array (Arrow text, int64 numpy), and the deletes, as Column.capture gives them
        n = len(index)  # slots, dead ones too
        live = n - index.killed
        dead = _dead_mask(index) if index.killed else None
        deleted = [k for k, e in self.deleted.items() if e > since] if self.deleted else []
        if full:
            if not live:
                return None
            complete = True
        else:
            try:
                stamps = object.__getattribute__(self, "stamps")
            except AttributeError:
                stamps = None  # no write since it was probed (a write makes the stamps first)
            if stamps is None or not n:
                changed = np.empty(0, np.int64)
            else:
                changed = np.flatnonzero(np.frombuffer(stamps, dtype=np.int64) > since)
                if dead is not None and len(changed):
                    changed = changed[~dead[changed]]
            if not len(changed) and not deleted:
                return None
            complete = live > 0 and len(changed) >= _IMAGE_SHARE * live
        values = self._values_np()
        if complete:
            if dead is None:
                return Captured(keys=_keys_of(index, None), values=values.copy(), nulls=self.null_mask(None),
                                changed=None, deleted=deleted, all_rows=True, complete=True)
            rows = np.flatnonzero(~dead)
            return Captured(keys=_keys_of(index, rows), values=values[rows], nulls=self.null_mask(rows),
                            changed=None, deleted=deleted, all_rows=True, complete=True)
        return Captured(keys=_keys_of(index, changed), values=values[changed], nulls=self.null_mask(changed),
                        changed=None, deleted=deleted, all_rows=False, complete=False)


def _dead_mask(index: Any) -> np.ndarray:
    """A probed key group's dead slots (deleted keys) as a bool mask over its ``len(index)``
    slots, from the index's bitmap."""
    n = len(index)
    bits = index.dead_bits()
    if bits is None:
        return np.zeros(n, dtype=bool)
    return np.unpackbits(np.frombuffer(bits, dtype=np.uint8), count=n, bitorder="little").view(bool)


def _keys_of(index: Any, rows: np.ndarray | None) -> np.ndarray | pa.Array:
    """The keys of a probed key group's slots ``rows`` (ascending; None: every slot): the
    restored array's, then those added since (an int64 array, or an Arrow array of the
    restored keys' type), as a capture copies them."""
    keys, extra = index.keys, index.extra_keys or []
    base = index.base
    if rows is None:
        cut, added = None, extra
    else:
        split = int(np.searchsorted(rows, base))
        cut, added = rows[:split], [extra[i] for i in (rows[split:] - base).tolist()]
    if isinstance(keys, np.ndarray):
        head = keys.copy() if cut is None else keys[cut]
        return np.concatenate([head, np.array(added, dtype=np.int64)]) if added else head
    head = keys if cut is None else keys.take(pa.array(cut))
    return pa.concat_arrays([head, pa.array(added, keys.type)]) if added else head
