"""The vectorized keyed aggregate (``KeyedStream.aggregate``): a columnar state store for
integer keys, and the dict-based :class:`~abs.state.KeyedStateBackend` path for other keys.

Columnar path (the key column has an Arrow integer type)
========================================================
Per subtask, :class:`ColumnarKeyedState` keeps every key of the operator in one *slot*:

* ``keys`` (int64), ``kg`` (int16: the key group, computed once with
  :func:`abs.keygroups.key_groups` when the key first arrives) and ``ver`` (int64: the epoch of
  the last change, 0 = never changed since restore) are numpy arrays indexed by slot, in
  insertion order, grown by doubling;
* per declared state a numpy accumulator (int64, uint64 for ``uint64`` states, float64 for
  floating states) and two bool arrays: ``valid`` (the value is not null) and ``present`` (the
  key has an entry in that state; an entry may hold a null value, exactly like the dict path);
* :class:`_SlotMap` (key -> slot): keys of a dense range ``[base, base + len)`` (ids usually
  are dense) are found with one gather in an int32 array; the others in :class:`_IntKeyIndex`,
  an open-addressing hash index (linear probing, load <= 1/2, one ``(key, slot)`` row per
  position so a probe is one cache miss; all operations vectorized over a batch, new keys of a
  batch claim free positions with a write-then-check, rebuilds place every key at once from
  the sorted home positions).

A batch is folded in without any group-by: every row is looked up (new keys are deduplicated
with a sort and inserted), then ``np.add.at`` / ``np.minimum.at`` / ``np.maximum.at``
(``np.fmin.at`` / ``np.fmax.at`` for floats: NaN is ignored unless a key only ever saw NaN,
like Arrow's ``min``/``max``) fold the rows straight into the accumulators; null inputs are
skipped (``count`` counts non-null values; a key whose inputs were all null holds a null
``sum``/``min``/``max``, like pyarrow's ``group_by``). ``emit="updates"`` then emits one row per
distinct key of the batch, in order of first appearance (Arrow's hash group-by, used by the
dict path, mostly but not always orders groups that way). Integer sums are exact int64 (they
wrap on overflow, as Arrow's per-batch sums do); float sums add row by row, so their last bits
may differ from the dict path's per-batch partial sums.

Dirty tracking with the semantics of KeyedStateBackend
------------------------------------------------------
Writes happen in *epochs*; ``capture(n)`` closes the current epoch ``e`` (remembered as the
epoch of ``n``) and opens ``e + 1``. A key changed since checkpoint ``c`` is a key whose
``ver`` is greater than the epoch closed by ``c``. ``confirm(n)`` moves the confirmed epoch to
the epoch of the newest pending capture ``<= n`` (the captures it implies); ``abort`` only drops
the id (nothing is forgotten). So ``capture(n)`` returns every key changed since the last
confirmed capture, exactly as the dict backend's pending key sets do, whatever the order of
confirmations and aborts. Per epoch the slots first touched in it are appended to a list, so a
capture reads only what changed (a mask scan over ``ver`` replaces the union of the lists when
they are large). The synchronous part of a snapshot copies the changed slots' keys, key
groups and values (plain copies when every slot changed); with ``lazy=True`` the split by key
group (one stable argsort) and the Arrow encoding happen in ``to_table()`` (the asynchronous
part), as for the dict backend's ``PendingDelta``. The tables have exactly the schema the dict
backend writes for the same typed ``ValueState`` (``key`` int64, ``value`` of the declared
type, ``op`` int8 not null, the ``abs.*`` metadata), so storage, restore and inspection do not
see a difference and snapshots restore into either path.

Fallback
========
:class:`AggregateBackend` is what :class:`~abs.runtime.operators.KeyedOp` sees as
``self.backend``. It starts columnar and migrates, once and for good, to the dict backend when
a batch's key column is not an integer type, has nulls or holds uint64 keys beyond int64, when a
value column is neither integer nor floating, or when a restored table is not an int64-keyed
typed table. The migration keeps every value, and every key changed since the last confirmed
checkpoint stays dirty (later deltas may carry a few more keys than strictly needed, never
fewer).
"""
from __future__ import annotations

import threading
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import GraphError
from ..keygroups import KeyGroupRange, key_groups
from ..state import (
    META_KEY_ENCODING,
    META_STATE_KIND,
    META_VALUE_ENCODING,
    KeyedStateBackend,
    StateError,
    check_restore_table,
)

__all__ = ["AggregateBackend", "Aggregator", "ColumnarKeyedState"]

_INT64_MAX = np.iinfo(np.int64).max
_H1 = np.uint64(0x9E3779B97F4A7C15)
_H2 = np.uint64(0xBF58476D1CE4E5B9)
_S31 = np.uint64(31)


def _acc_dtype(t: pa.DataType) -> np.dtype:
    """numpy accumulator of a state of Arrow type ``t`` (None: not columnar)."""
    if pa.types.is_floating(t):
        return np.dtype(np.float64)
    if pa.types.is_uint64(t):
        return np.dtype(np.uint64)
    if pa.types.is_integer(t):
        return np.dtype(np.int64)
    return None


_EMIT_TYPE = {np.dtype(np.float64): pa.float64(), np.dtype(np.int64): pa.int64(), np.dtype(np.uint64): pa.uint64()}


# ----------------------------------------------------------------------------- hash index


class _IntKeyIndex:
    """Vectorized open-addressing hash index int64 key -> slot (linear probing, no deletes).

    One int64 row ``(key, slot)`` per position, so a probe costs one cache miss; an empty
    position has slot -1 (its key is irrelevant). Home positions come from the high bits of a
    multiplicative hash (keys of one subtask share low bits of their key-group hash, and
    sequential keys must not cluster). Probing does not wrap around: the table has spare rows
    after the ``cap`` home positions; an insert that would run past the end makes the caller
    rebuild. Lookups step all unresolved keys one position at a time while many remain, then
    scan windows of ``_WINDOW`` positions for the few long probe sequences left."""

    __slots__ = ("t", "cap", "shift", "size")

    def __init__(self, capacity: int = 1024) -> None:
        bits = max(4, int(capacity - 1).bit_length())
        self.cap = 1 << bits
        self.shift = np.uint64(64 - bits)
        self.t = self._alloc(self.cap + _WINDOW + self.cap // 64)
        self.size = 0

    @staticmethod
    def _alloc(rows: int) -> np.ndarray:
        t = np.zeros((rows, 2), np.int64)
        t[:, 1] = -1
        return t

    def _homes(self, keys: np.ndarray) -> np.ndarray:
        x = keys.view(np.uint64) * _H1
        x ^= x >> _S31
        x *= _H2
        x >>= self.shift
        return x.view(np.int64)

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slot of every key, -1 where absent; per key the position where its probe ended:
        for an absent key the first empty position of its probe sequence, or the table length
        when the sequence runs off the end)."""
        t = self.t
        rows = len(t)
        pos = self._homes(keys)
        r = np.take(t, pos, axis=0)
        s = r[:, 1]
        hit = r[:, 0] == keys
        out = np.where(hit, s, -1)  # an empty position holding the key gives -1 as well
        idx = np.flatnonzero(~hit & (s >= 0))
        while idx.size:
            if idx.size > _STEP_ABOVE:
                p = pos[idx] + 1
                off = p >= rows
                if off.any():  # ran off the end: absent, and no room after it
                    pos[idx[off]] = rows
                    idx, p = idx[~off], p[~off]
                pos[idx] = p
                r = np.take(t, p, axis=0)
                s = r[:, 1]
                hit = r[:, 0] == keys[idx]
                if hit.any():
                    out[idx[hit]] = s[hit]
                idx = idx[~hit & (s >= 0)]
            else:
                base = pos[idx] + 1
                win = np.minimum(base[:, None] + _WIN, rows - 1)
                rr = np.take(t, win, axis=0)
                ss = rr[:, :, 1]
                empty = ss < 0
                match = (rr[:, :, 0] == keys[idx][:, None]) & ~empty
                found = match.any(1)
                if found.any():
                    out[idx[found]] = ss[found, match[found].argmax(1)]
                has_empty = empty.any(1)
                ends = ~found & has_empty
                pos[idx[ends]] = base[ends] + empty[ends].argmax(1)
                go_on = ~found & ~has_empty
                off_end = go_on & (base + _WINDOW >= rows)
                pos[idx[off_end]] = rows
                go_on &= ~off_end
                pos[idx[go_on]] = base[go_on] + (_WINDOW - 1)
                idx = idx[go_on]
        return out, pos

    def insert(self, keys: np.ndarray, slots: np.ndarray, start: np.ndarray) -> bool:
        """Add distinct keys absent from the index, probing from ``start`` (the end positions
        :meth:`lookup` returned for them). Several keys may claim one free position: one
        write wins, the others go on (to the next free position of a window once few are
        left). False when a key would land past the table end (the table is then partly
        filled: rebuild it)."""
        t = self.t
        col = t[:, 1]
        rows = len(t)
        pos = start.copy()
        idx = np.arange(len(keys))
        while idx.size:
            p = pos[idx]
            if p.max() >= rows:
                return False
            if idx.size > _STEP_ABOVE:
                free = col[p] < 0
                cand = idx[free]
                at = p[free]
                moving = idx[~free]
                pos[moving] += 1
            else:
                win = np.minimum(p[:, None] + _WIN, rows - 1)
                free = col[win] < 0
                has = free.any(1)
                cand = idx[has]
                at = p[has] + free[has].argmax(1)
                moving = idx[~has]
                pos[moving] += _WINDOW
            col[at] = slots[cand]
            won = col[at] == slots[cand]
            t[at[won], 0] = keys[cand[won]]
            lost = cand[~won]
            pos[lost] = at[~won] + 1
            idx = np.concatenate((moving, lost))
        self.size += len(keys)
        return True

    def build(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Fill an empty index with distinct keys at once: sorted by home position, key ``i``
        lands at ``max(home_i, position_{i-1} + 1)``, i.e. ``i + cummax(home - i)`` (exactly
        where linear probing puts it)."""
        home = self._homes(keys)
        order = np.argsort(home)
        i = np.arange(len(order))
        pos = i + np.maximum.accumulate(home[order] - i)
        if len(pos) and pos[-1] + 1 + _WINDOW > len(self.t):
            self.t = self._alloc(int(pos[-1]) + 1 + _WINDOW + self.cap // 64)
        self.t[pos, 0] = keys[order]
        self.t[pos, 1] = slots[order]
        self.size = len(keys)


_WINDOW = 32  # positions scanned at once when few probes are left
_WIN = np.arange(_WINDOW)
_STEP_ABOVE = 128  # more unresolved keys than this: step them one position at a time
_MAX_LOAD = 0.5  # keys per home position before the index doubles


class _SlotMap:
    """key -> slot. Keys in ``[base, base + len(direct))`` live in a dense int32 array (ids are
    often dense: one gather per lookup, no hashing); the others in :class:`_IntKeyIndex`.

    The dense range starts at the smallest key of the first keys placed when they are dense
    enough, and grows (by doubling) to cover new keys below ``base + max(65536, 4 * keys)``,
    so it never costs more than about 32 bytes per key. It is authoritative for its range: when
    it grows, the keys it now covers are copied in (their stale hash entries are never looked
    up again and are dropped at the next hash rebuild)."""

    __slots__ = ("direct", "base", "hash")

    def __init__(self) -> None:
        self.direct: np.ndarray | None = None
        self.base = 0
        self.hash = _IntKeyIndex(16)

    def _in_direct(self, keys: np.ndarray) -> np.ndarray:
        hi = min(self.base + len(self.direct), _INT64_MAX)
        return (keys >= self.base) & (keys < hi)

    def find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """(slot of every key, -1 where absent; where hash-probed absent keys' probes ended,
        -1 for keys not probed; None when no key was probed)."""
        d = self.direct
        if d is None:
            if not self.hash.size:
                return np.full(len(keys), -1, np.int64), None
            return self.hash.lookup(keys)
        base = self.base
        if len(keys) and keys.min() >= base and int(keys.max()) < base + len(d):
            return d[keys - base if base else keys].astype(np.int64), None
        inr = self._in_direct(keys)
        slots = np.full(len(keys), -1, np.int64)
        slots[inr] = d[keys[inr] - base]
        if not self.hash.size:
            return slots, None
        out = np.flatnonzero(~inr)
        hs, he = self.hash.lookup(keys[out])
        slots[out] = hs
        ends = np.full(len(keys), -1, np.int64)
        ends[out] = he
        return slots, ends

    def place(self, all_keys: np.ndarray, new: np.ndarray, slots: np.ndarray, start: np.ndarray | None) -> None:
        """Add distinct absent keys ``new`` (already stored at ``slots`` of ``all_keys``, the
        store's keys including them); ``start``: their probe ends from :meth:`find`."""
        self._grow_direct(all_keys, new)
        if self.direct is not None:
            inr = self._in_direct(new)
            self.direct[new[inr] - self.base] = slots[inr]
            if inr.all():
                return
            out = ~inr
            new, slots = new[out], slots[out]
            start = None if start is None else start[out]
        h = self.hash
        if start is None:
            start = h._homes(new)  # nothing was probed: the hash was empty, homes are free
        else:
            unknown = start < 0
            if unknown.any():
                start = start.copy()
                start[unknown] = h._homes(new[unknown])
        full = h.size + len(new) > _MAX_LOAD * h.cap
        if full or not h.insert(new, slots, start):
            mask = np.ones(len(all_keys), bool) if self.direct is None else ~self._in_direct(all_keys)
            keys = all_keys[mask]
            index = _IntKeyIndex(int(2 * len(keys) / _MAX_LOAD) if full else h.cap)
            index.build(keys, np.flatnonzero(mask))
            self.hash = index

    def _grow_direct(self, all_keys: np.ndarray, new: np.ndarray) -> None:
        if not len(new):
            return
        n = len(all_keys)
        limit = max(_DIRECT_MIN, _DIRECT_PER_KEY * n)
        if self.direct is None:
            base = int(new.min())
            if 0 <= base < limit:
                base = 0  # ids usually start near 0
            if base > _INT64_MAX - 2 * limit or base < -(2**62):
                return
            covered = new[new < base + limit]
            if len(covered) * 2 < len(new):  # the new keys are not dense: no dense range (yet)
                return
            self.base = base
            old = 0
        else:
            base = self.base
            old = len(self.direct)
            covered = new[(new >= base + old) & (new < min(base + limit, _INT64_MAX))]
            if not len(covered):
                return
        size = 1 << int(int(covered.max()) - base).bit_length()
        if size <= old:
            return
        direct = np.full(size, -1, np.int32)
        if old:
            direct[:old] = self.direct
        self.direct = direct
        # keys placed before that the range now covers (in the hash until now)
        moved = np.flatnonzero((all_keys >= base + old) & (all_keys < base + size))
        direct[all_keys[moved] - base] = moved


_SUM_RECHECK = 2.0**62  # the bound of int64 sums is recomputed exactly past this
_SUM_LIMIT = 2.0**63 * 0.999  # margin for float rounding
_DIRECT_MIN = 1 << 16
_DIRECT_PER_KEY = 4


# ----------------------------------------------------------------------------- columnar store


class _Column:
    """Accumulators of one declared state."""

    __slots__ = ("descriptor", "name", "arrow_type", "dtype", "init", "values", "valid", "present",
                 "all_valid", "all_present", "schema", "bound")

    def __init__(self, descriptor: Any, init: Any, capacity: int) -> None:
        self.descriptor = descriptor
        self.name = descriptor.name
        self.arrow_type = descriptor.value_arrow_type()
        self.dtype = _acc_dtype(self.arrow_type)
        self.init = init
        self.values = np.full(capacity, init, self.dtype)
        self.valid = np.zeros(capacity, bool)
        self.present = np.zeros(capacity, bool)
        self.all_valid: bool | None = True  # every slot < n is valid (None: unknown)
        self.all_present: bool | None = True  # every slot < n is present (None: unknown)
        self.bound: float | None = 0.0  # >= every |value| of an int64 sum (None: unknown)
        self.schema = pa.schema(
            [pa.field("key", pa.int64()), pa.field("value", self.arrow_type), pa.field("op", pa.int8(), nullable=False)],
            metadata={META_KEY_ENCODING: b"arrow", META_VALUE_ENCODING: b"arrow",
                      META_STATE_KIND: descriptor.kind.encode()},
        )

    def grow(self, capacity: int, n: int) -> None:
        values = np.full(capacity, self.init, self.dtype)
        values[:n] = self.values[:n]
        valid = np.zeros(capacity, bool)
        valid[:n] = self.valid[:n]
        present = np.zeros(capacity, bool)
        present[:n] = self.present[:n]
        self.values, self.valid, self.present = values, valid, present


def columnar_descriptors_ok(descriptors: Any) -> bool:
    return all(d.kind == "value" and d.type is not None and _acc_dtype(d.type) is not None for d in descriptors)


class ColumnarKeyedState:
    """Keyed state of one aggregate subtask for int64 keys; the snapshot API (``capture``,
    ``capture_full``, ``confirm``, ``abort``, ``restore``) of :class:`KeyedStateBackend` with
    the same semantics and the same table encoding (see the module docstring)."""

    def __init__(self, operator_uid: str, descriptors: Any, max_parallelism: int,
                 key_group_range: KeyGroupRange, inits: dict | None = None) -> None:
        self.operator_uid = operator_uid
        self.max_parallelism = max_parallelism
        self.key_group_range = key_group_range
        self.n = 0
        self.capacity = 1024
        self.keys = np.zeros(self.capacity, np.int64)
        self.kg = np.zeros(self.capacity, np.int16)
        self.ver = np.zeros(self.capacity, np.int64)
        self.kg_counts = np.zeros(max_parallelism, np.int64)  # keys per key group
        inits = inits or {}
        self.columns: dict[str, _Column] = {
            d.name: _Column(d, inits.get(d.name, 0), self.capacity) for d in descriptors
        }
        self.map = _SlotMap()
        self.epoch = 1
        self.confirmed_epoch = 0
        self.dirty: dict[int, list[np.ndarray]] = {1: []}  # epoch -> slots first changed in it
        self._scan_until = 0  # lists of epochs <= this were dropped: scan while unconfirmed
        self._pending: dict[int, int] = {}  # checkpoint id -> epoch it closed, ascending
        self._last_captured: int | None = None
        self._last_confirmed: int | None = None

    # ------------------------------------------------------------------ introspection
    @property
    def descriptors(self) -> tuple:
        return tuple(c.descriptor for c in self.columns.values())

    @property
    def last_confirmed(self) -> int | None:
        return self._last_confirmed

    @property
    def pending_captures(self) -> tuple[int, ...]:
        return tuple(self._pending)

    def _col(self, name: str) -> _Column:
        try:
            return self.columns[name]
        except KeyError:
            declared = ", ".join(map(repr, self.columns)) or "none"
            raise StateError(
                f"operator {self.operator_uid!r} has no state named {name!r} (declared: "
                f"{declared}); declare it in the operator's state=[...]"
            ) from None

    def items(self, name: str, kg: int | None = None) -> Iterator[tuple[Any, Any]]:
        """(key, value) pairs of state ``name`` (value None when null); for tests/inspection."""
        col = self._col(name)
        sel = col.present[: self.n].copy()
        if kg is not None:
            sel &= self.kg[: self.n] == kg
        slots = np.flatnonzero(sel)
        vals = col.values[slots].tolist()
        valid = col.valid[slots].tolist()
        return iter([(k, v if ok else None) for k, v, ok in zip(self.keys[slots].tolist(), vals, valid)])

    def changed_since_confirmed(self) -> np.ndarray:
        """Sorted distinct slots changed since the last confirmed capture: the union of the
        per-epoch lists, or a scan of ``ver`` when they are long (or were dropped: when many
        captures go unconfirmed, e.g. while storage fails, the lists would grow with every
        epoch; past twice the key count they are dropped and captures scan until a
        confirmation passes the epoch where they were dropped)."""
        if self.confirmed_epoch < self._scan_until:
            return np.flatnonzero(self.ver[: self.n] > self.confirmed_epoch)
        lists = [a for e, arrs in self.dirty.items() if e > self.confirmed_epoch for a in arrs]
        total = sum(len(a) for a in lists)
        if not total:
            return np.zeros(0, np.int64)
        if total * 4 > self.n:
            if total > 2 * self.n:
                self._scan_until = self.epoch
                self.dirty = {self.epoch: []}
            return np.flatnonzero(self.ver[: self.n] > self.confirmed_epoch)
        return _distinct(np.concatenate(lists))

    # ------------------------------------------------------------------ slots
    def _grow(self, need: int) -> None:
        cap = max(need, 2 * self.capacity)
        n = self.n
        for name in ("keys", "kg", "ver"):
            old = getattr(self, name)
            new = np.zeros(cap, old.dtype)
            new[:n] = old[:n]
            setattr(self, name, new)
        for col in self.columns.values():
            col.grow(cap, n)
        self.capacity = cap

    def _append(self, keys: np.ndarray, kgs: np.ndarray, start: np.ndarray | None, present: bool) -> np.ndarray:
        """New slots for distinct keys absent from the index (``start``: where their lookup
        ended)."""
        n0 = self.n
        n1 = n0 + len(keys)
        if n1 > self.capacity:
            self._grow(n1)
        self.keys[n0:n1] = keys
        self.kg[n0:n1] = kgs
        self.kg_counts += np.bincount(kgs, minlength=self.max_parallelism)
        self.ver[n0:n1] = 0
        for col in self.columns.values():
            col.values[n0:n1] = col.init
            col.valid[n0:n1] = False
            col.present[n0:n1] = present
        self.n = n1
        slots = np.arange(n0, n1, dtype=np.int64)
        self.map.place(self.keys[:n1], keys, slots, start)
        return slots

    def slots_for(self, keys: np.ndarray) -> np.ndarray:
        """Slot of every key of a batch (int64 array), inserting new keys (present in every
        state; their key groups must be in this subtask's range)."""
        slots, ends = self.map.find(keys)
        miss = slots < 0
        if miss.any():
            new, inverse = _distinct_inverse(keys[miss])
            start = None
            if ends is not None:
                start = np.empty(len(new), np.int64)
                start[inverse] = ends[miss]  # duplicates of a key share its probe end
            kgs = key_groups(new, self.max_parallelism)
            rng = self.key_group_range
            bad = (kgs < rng.start) | (kgs > rng.end)
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise StateError(
                    f"operator {self.operator_uid!r}: key {int(new[i])!r} belongs to key group "
                    f"{int(kgs[i])}, outside this subtask's range {rng}; the record was routed to "
                    "the wrong subtask (routing table and key-group range disagree)"
                )
            slots[miss] = self._append(new, kgs.astype(np.int16), start, present=True)[inverse]
        return slots

    def touch(self, slots: np.ndarray) -> None:
        """Record that ``slots`` changed in the current epoch."""
        epoch = self.epoch
        fresh = slots[self.ver[slots] != epoch]
        if fresh.size:
            self.ver[fresh] = epoch
            self.dirty[epoch].append(fresh)

    # ------------------------------------------------------------------ snapshots
    def _check_capture_id(self, checkpoint_id: int) -> None:
        if type(checkpoint_id) is not int:
            raise StateError(f"operator {self.operator_uid!r}: checkpoint id {checkpoint_id!r} is not an int")
        for last, what in ((self._last_captured, "captured"), (self._last_confirmed, "confirmed")):
            if last is not None and checkpoint_id <= last:
                raise StateError(
                    f"operator {self.operator_uid!r}: capture({checkpoint_id}) after checkpoint "
                    f"{last} was already {what}; checkpoint ids must increase (a runtime bug)"
                )

    def _close_epoch(self, checkpoint_id: int) -> None:
        self._check_capture_id(checkpoint_id)
        self._pending[checkpoint_id] = self.epoch
        self._last_captured = checkpoint_id
        self.epoch += 1
        self.dirty[self.epoch] = []

    def capture(self, checkpoint_id: int, *, lazy: bool = False) -> dict[str, dict[int, Any]]:
        """State name -> key group -> delta of every key changed since the last confirmed
        checkpoint (every declared state appears, possibly with ``{}``).

        The changed slots' keys, key groups and values are copied now (gathers of sorted slots).
        ``lazy=False``: the deltas are ``pa.Table`` at once. ``lazy=True``: they are
        :class:`_LazyDelta` objects whose ``to_table()`` does the split by key group and the
        Arrow encoding later (the asynchronous part), as KeyedStateBackend's PendingDelta."""
        slots = self.changed_since_confirmed()
        self._close_epoch(checkpoint_id)
        frozen = _Frozen(self, slots)
        if not lazy:
            return frozen.encode()
        kgs = frozen.key_groups()
        return {name: {kg: _LazyDelta(frozen, name, kg) for kg in kgs} for name in self.columns}

    def capture_full(self, checkpoint_id: int) -> dict[str, dict[int, pa.Table]]:
        """Every non-empty key group's full contents (counts as a capture)."""
        self._close_epoch(checkpoint_id)
        return _Frozen(self, np.arange(self.n, dtype=np.int64)).encode()

    def confirm(self, checkpoint_id: int) -> None:
        if self._last_confirmed is not None and checkpoint_id <= self._last_confirmed:
            return
        done = [c for c in self._pending if c <= checkpoint_id]
        if done:
            self.confirmed_epoch = self._pending[done[-1]]
            for c in done:
                del self._pending[c]
            for e in [e for e in self.dirty if e <= self.confirmed_epoch]:
                del self.dirty[e]
        self._last_confirmed = checkpoint_id

    def abort(self, checkpoint_id: int) -> None:
        """Nothing is forgotten: keys stay changed relative to the confirmed epoch."""
        self._pending.pop(checkpoint_id, None)

    # ------------------------------------------------------------------ restore
    def check_restore_table(self, state_name: str, kg: int, table: pa.Table) -> bool:
        """Validate like the dict backend (raises StateError); True when the table fits the
        columnar store (int keys, typed numeric values), False when it needs the dict path."""
        col = self._col(state_name)
        if type(kg) is not int or kg not in self.key_group_range:
            raise StateError(
                f"operator {self.operator_uid!r}: restore: key group {kg!r} is outside this "
                f"subtask's range {self.key_group_range}; the record or call was routed to the "
                "wrong subtask"
            )
        where = f"operator {self.operator_uid!r}, state {state_name!r}, key group {kg}"
        meta = table.schema.metadata or {}
        check_restore_table(table, col.descriptor.kind, where)
        if meta.get(META_KEY_ENCODING, b"arrow") != b"arrow" or meta.get(META_VALUE_ENCODING, b"arrow") != b"arrow":
            return False
        kt = table.schema.field("key").type
        vt = table.schema.field("value").type
        if not pa.types.is_integer(kt) or table.column("key").null_count:
            return False
        if pa.types.is_uint64(kt) and table.num_rows and pc.max(table.column("key")).as_py() > _INT64_MAX:
            return False
        if pa.types.is_integer(vt):
            return True
        return pa.types.is_floating(vt) and col.dtype.kind == "f"

    def restore(self, state_name: str, kg: int, table: pa.Table, *, verify: bool = False) -> None:
        """Upsert a resolved table (checked with :meth:`check_restore_table`) into state
        ``state_name``; restored keys are not dirty. New keys are recorded in key group
        ``kg`` (``verify=True`` checks that every key hashes to it)."""
        col = self._col(state_name)
        if not table.num_rows:
            return
        keys = _numpy_int64(table.column("key"))
        if verify:
            actual = key_groups(keys, self.max_parallelism)
            wrong = np.flatnonzero(actual != kg)
            if wrong.size:
                k = int(keys[wrong[0]])
                raise StateError(
                    f"operator {self.operator_uid!r}, state {state_name!r}, key group {kg}: key "
                    f"{k!r} belongs to key group {int(actual[wrong[0]])}; the snapshot file is in "
                    "the wrong key group (corrupt or re-keyed with another max_parallelism)"
                )
        slots, ends = self.map.find(keys)
        miss = slots < 0
        if miss.any():
            new, inverse = _distinct_inverse(keys[miss])
            start = None
            if ends is not None:
                start = np.empty(len(new), np.int64)
                start[inverse] = ends[miss]
            slots[miss] = self._append(new, np.full(len(new), kg, np.int16), start, present=False)[inverse]
        varr = table.column("value")
        varr = varr.combine_chunks() if isinstance(varr, pa.ChunkedArray) else varr
        if varr.null_count:
            valid = varr.is_valid().to_numpy(zero_copy_only=False)
            vals = varr.fill_null(0).to_numpy(zero_copy_only=False).astype(col.dtype)
            vals[~valid] = col.init
        else:
            valid = np.ones(len(varr), bool)
            vals = varr.to_numpy(zero_copy_only=False).astype(col.dtype)
        col.values[slots] = vals
        col.valid[slots] = valid
        col.present[slots] = True
        for c in self.columns.values():
            c.all_valid = None
            c.all_present = None
            c.bound = None

    def refresh_flags(self) -> None:
        n = self.n
        for c in self.columns.values():
            if c.all_valid is None:
                c.all_valid = bool(c.valid[:n].all())
            if c.all_present is None:
                c.all_present = bool(c.present[:n].all())

    # ------------------------------------------------------------------ migration
    def move_to(self, target: KeyedStateBackend) -> None:
        """Load everything into an empty dict backend: keys changed since the last confirmed
        checkpoint become dirty there (via put_many), the others are restored (clean)."""
        if self._last_captured is not None:
            target.capture(self._last_captured)  # empty: only advances its id checks
            target.abort(self._last_captured)
        if self._last_confirmed is not None:
            target.confirm(self._last_confirmed)
        n = self.n
        dirty = self.ver[:n] > self.confirmed_epoch
        for want_dirty in (False, True):
            for name, by_kg in _Frozen(self, np.flatnonzero(dirty == want_dirty)).encode().items():
                for g, table in by_kg.items():
                    if want_dirty:
                        target.put_many(name, g, table.column("key").to_pylist(), table.column("value").to_pylist())
                    else:
                        target.restore(name, g, table)


class _Frozen:
    """Copies, taken at capture, of some slots' key groups, keys and per-state values,
    encoded into per-key-group delta tables on demand (once; thread-safe)."""

    def __init__(self, store: ColumnarKeyedState, slots: np.ndarray) -> None:
        self.uid = store.operator_uid
        n = store.n
        if len(slots) == n:  # every slot (slots is then 0..n-1): plain copies beat gathers
            sel: Any = slice(0, n)
            self._groups: list[int] | None = np.flatnonzero(store.kg_counts).tolist()
            self._complete: Any = True
        else:
            sel = slots
            self._groups = None
            # key groups whose every slot changed: their deltas are full images (no deletes
            # exist in this store), which storage writes as new bases without reading the chain
            counts = np.bincount(store.kg[slots], minlength=len(store.kg_counts))
            self._complete = (counts == store.kg_counts) & (counts > 0)
        self.kgs = store.kg[sel].copy()
        self.keys = store.keys[sel].copy()
        # (None: every slot of the store is valid / present, nothing to copy)
        self.cols = [(c, c.values[sel].copy(), None if c.all_valid else c.valid[sel].copy(),
                      None if c.all_present else c.present[sel].copy()) for c in store.columns.values()]
        self._lock = threading.Lock()
        self._tables: dict[str, dict[int, pa.Table]] | None = None

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

    def table(self, name: str, kg: int) -> pa.Table:
        tables = self.encode()
        got = tables[name].get(kg)
        if got is None:  # the key group's slots hold no entry of this state
            col = next(c for c, *_ in self.cols if c.name == name)
            got = col.schema.empty_table()
        return got

    def encode(self) -> dict[str, dict[int, pa.Table]]:
        with self._lock:
            if self._tables is None:
                self._tables = self._encode()
            return self._tables

    def _encode(self) -> dict[str, dict[int, pa.Table]]:
        out: dict[str, dict[int, pa.Table]] = {}
        if not len(self.kgs):
            return {c.name: {} for c, *_ in self.cols}
        order = np.argsort(self.kgs, kind="stable")
        kgs = self.kgs[order]
        keys = self.keys[order]
        for col, values, valid, present in self.cols:
            if valid is None:
                valid = np.ones(len(values), bool)
            present = None if present is None else present[order]
            if present is None or present.all():
                out[col.name] = self._split(col, keys, kgs, values[order], valid[order])
            else:
                sel = order[present]
                out[col.name] = self._split(col, keys[present], kgs[present], values[sel], valid[sel])
        self.cols = [(c, None, None, None) for c, *_ in self.cols]  # free the copies
        return out

    def _split(self, col: _Column, keys: np.ndarray, kgs: np.ndarray, vals: np.ndarray, valid: np.ndarray) -> dict[int, pa.Table]:
        m = len(keys)
        if not m:
            return {}
        values = pa.array(vals, mask=None if valid.all() else ~valid)
        if values.type != col.arrow_type:
            try:
                values = values.cast(col.arrow_type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise StateError(
                    f"operator {self.uid!r}, state {col.name!r}: a value does not fit the declared "
                    f"Arrow type {col.arrow_type} ({exc}); aggregate with a wider value_type"
                ) from exc
        key_arr = pa.array(keys)
        op_arr = pa.array(np.zeros(m, np.int8))
        cuts = np.flatnonzero(kgs[1:] != kgs[:-1]) + 1
        starts = [0] + cuts.tolist()
        ends = cuts.tolist() + [m]
        schema = col.schema
        out = {}
        for s, e, g in zip(starts, ends, kgs[starts].tolist()):
            ln = e - s
            out[g] = pa.Table.from_arrays([key_arr.slice(s, ln), values.slice(s, ln), op_arr.slice(s, ln)], schema=schema)
        return out


class _LazyDelta:
    """One key group's delta of one state; ``to_table()`` encodes (in the asynchronous part)."""

    __slots__ = ("_frozen", "_name", "_kg")

    def __init__(self, frozen: _Frozen, name: str, kg: int) -> None:
        self._frozen = frozen
        self._name = name
        self._kg = kg

    def to_table(self) -> pa.Table:
        return self._frozen.table(self._name, self._kg)

    @property
    def complete(self) -> bool:
        """The delta holds every live key of its key group (see ``SnapshotStore.write_key_group``)."""
        return self._frozen.complete(self._kg)


# Sort-based set operations: numpy 2.x's np.unique takes a slow hashing path for integers
# (about 20x slower than a sort for 10,000 int64s).


def _distinct(x: np.ndarray) -> np.ndarray:
    """Sorted distinct values."""
    s = np.sort(x)
    if len(s) > 1:
        s = s[np.concatenate(([True], s[1:] != s[:-1]))]
    return s


def _distinct_inverse(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct values and, per element of ``x``, the index of its value in them."""
    order = np.argsort(x)  # not stable: 3-4x faster than a stable sort on unordered int64s
    s = x[order]
    flag = np.empty(len(s), bool)
    flag[:1] = True
    np.not_equal(s[1:], s[:-1], out=flag[1:])
    inverse = np.empty(len(x), np.intp)
    inverse[order] = np.cumsum(flag) - 1
    return s[flag], inverse


def _first_occurrences(x: np.ndarray) -> np.ndarray:
    """Positions of the first occurrence of each distinct value, in order of appearance."""
    if not len(x):
        return np.zeros(0, np.intp)
    order = np.argsort(x)
    s = x[order]
    flag = np.empty(len(s), bool)
    flag[:1] = True
    np.not_equal(s[1:], s[:-1], out=flag[1:])
    first = np.zeros(len(x), bool)
    first[np.minimum.reduceat(order, np.flatnonzero(flag))] = True  # earliest row of each value
    return np.flatnonzero(first)


def _numpy_int64(arr: Any) -> np.ndarray:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    out = arr.to_numpy(zero_copy_only=False)
    return out if out.dtype == np.int64 else out.astype(np.int64)


# ----------------------------------------------------------------------------- switching backend


class AggregateBackend:
    """The aggregate's state backend as seen by KeyedOp: columnar until something needs the
    dict backend (see the module docstring), then the dict backend for good."""

    def __init__(self, dict_backend: KeyedStateBackend, inits: dict, columnar: bool = True) -> None:
        self.dict_backend = dict_backend
        descriptors = dict_backend.descriptors
        self.columnar: ColumnarKeyedState | None = None
        if columnar and columnar_descriptors_ok(descriptors):
            self.columnar = ColumnarKeyedState(
                dict_backend.operator_uid, descriptors, dict_backend.max_parallelism,
                dict_backend.key_group_range, inits,
            )

    @property
    def impl(self) -> Any:
        return self.columnar if self.columnar is not None else self.dict_backend

    def migrate_to_dict(self) -> None:
        if self.columnar is not None:
            col, self.columnar = self.columnar, None
            col.move_to(self.dict_backend)

    # the snapshot API of KeyedStateBackend
    @property
    def descriptors(self) -> tuple:
        return self.dict_backend.descriptors

    @property
    def operator_uid(self) -> str:
        return self.dict_backend.operator_uid

    @property
    def max_parallelism(self) -> int:
        return self.dict_backend.max_parallelism

    @property
    def key_group_range(self) -> KeyGroupRange:
        return self.dict_backend.key_group_range

    @property
    def last_confirmed(self) -> int | None:
        return self.impl.last_confirmed

    @property
    def pending_captures(self) -> tuple[int, ...]:
        return self.impl.pending_captures

    def capture(self, checkpoint_id: int, **kwargs: Any) -> dict:
        if self.columnar is not None:
            return self.columnar.capture(checkpoint_id, lazy=bool(kwargs.get("lazy", False)))
        return self.dict_backend.capture(checkpoint_id, **kwargs)

    def capture_full(self, checkpoint_id: int) -> dict:
        return self.impl.capture_full(checkpoint_id)

    def confirm(self, checkpoint_id: int) -> None:
        self.impl.confirm(checkpoint_id)

    def abort(self, checkpoint_id: int) -> None:
        self.impl.abort(checkpoint_id)

    def restore(self, state_name: str, kg: int, table: pa.Table, *, verify: bool = False) -> None:
        if self.columnar is not None:
            if self.columnar.check_restore_table(state_name, kg, table):
                self.columnar.restore(state_name, kg, table, verify=verify)
                return
            self.migrate_to_dict()
        self.dict_backend.restore(state_name, kg, table, verify=verify)

    def items(self, name: str, kg: int | None = None) -> Iterator[tuple[Any, Any]]:
        return self.impl.items(name, kg)


# ----------------------------------------------------------------------------- the operator logic


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
        self.dtypes = {s: _acc_dtype(types[s]) for s, _c, _f in self.plan}
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
        ok = pa.types.is_integer(schema.field(ki).type)
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
            if self._columnar_schema and not keycol.null_count:
                keys = keycol.to_numpy()
                if keys.dtype != np.int64:
                    if keys.dtype == np.uint64 and keys.max() > _INT64_MAX:
                        keys = None
                    else:
                        keys = keys.astype(np.int64)
                if keys is not None:
                    return self._process_columnar(batch, keycol, keys)
            backend.migrate_to_dict()
        return self._process_dict(batch)

    def _process_columnar(self, batch: pa.RecordBatch, keycol: pa.Array, keys: np.ndarray) -> pa.RecordBatch | None:
        store = self.backend.columnar
        store.refresh_flags()
        n0 = store.n
        slots = store.slots_for(keys)
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
        first = _first_occurrences(slots)
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

    def _check_overflow(self, store: ColumnarKeyedState, c: _Column, slots: np.ndarray, v: np.ndarray) -> None:
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
            uniq, inverse = _distinct_inverse(slots)
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
        keys = keys_arr.to_pylist()
        partials = []
        for state, col, fn in self.plan:
            part = grouped.column(f"{col}_{fn}").to_pylist()
            if self.dtypes[state].kind == "f":
                part = [None if x is None else float(x) for x in part]
            partials.append(part)
        order = np.argsort(kgs, kind="stable")
        sorted_kgs = kgs[order]
        bounds = np.flatnonzero(np.diff(sorted_kgs)) + 1
        starts = np.concatenate(([0], bounds)).tolist()
        ends = np.concatenate((bounds, [len(order)])).tolist()
        new_values = [[None] * len(keys) for _ in self.plan]
        for s, e in zip(starts, ends):
            idx = order[s:e].tolist()
            kg = int(sorted_kgs[s])
            ks = [keys[i] for i in idx]
            for p, (state, _col, fn) in enumerate(self.plan):
                old = backend.get_many(state, kg, ks)
                part = partials[p]
                merge = _MERGE[fn]
                merged = [merge(o, part[i]) for o, i in zip(old, idx)]
                backend.put_many(state, kg, ks, merged)
                col_out = new_values[p]
                for i, v in zip(idx, merged):
                    col_out[i] = v
        if not self.emit_updates:
            return None
        values = {state: vals for (state, _c, _f), vals in zip(self.plan, new_values)}
        cols: dict[str, Any] = {"key": keys_arr.combine_chunks() if isinstance(keys_arr, pa.ChunkedArray) else keys_arr}
        for out, (_col, fn) in self.aggs.items():
            if fn == "mean":
                sums = pa.array(values[f"{out}.sum"], pa.float64())
                counts = pa.array(values[f"{out}.count"], pa.int64())
                cols[out] = pc.divide(sums, pc.cast(counts, pa.float64()))
            else:
                cols[out] = pa.array(values[out], _EMIT_TYPE[self.dtypes[out]])
        return pa.RecordBatch.from_pydict(cols)


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
