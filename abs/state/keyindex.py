"""Vectorized int64 key -> slot lookup for the columnar store (:mod:`abs.state.columnar`),
and sort-based set operations on int64 arrays.

:class:`SlotMap` (key -> slot): keys of a dense range ``[base, base + len)`` (ids usually are
dense) are found with one gather in an int32 array; the others in :class:`IntKeyIndex`, an
open-addressing hash index (linear probing, load <= 1/2, one ``(key, slot)`` row per position
so a probe is one cache miss; all operations vectorized over a batch, new keys of a batch claim
free positions with a write-then-check, rebuilds place every key at once from the sorted home
positions).
"""
from __future__ import annotations

import queue
import threading
import weakref
from typing import Any

import numpy as np

from abscore.native import NATIVE

__all__ = ["INT64_MAX", "BackgroundFill", "DirectFill", "HashFill", "IntKeyIndex", "SlotMap", "distinct", "distinct_inverse", "first_occurrences", "representatives"]

INT64_MAX = np.iinfo(np.int64).max
_H1 = np.uint64(0x9E3779B97F4A7C15)
_H2 = np.uint64(0xBF58476D1CE4E5B9)
_S31 = np.uint64(31)
_S32 = np.uint64(32)
_MAX_HOMES = 1 << 32  # home positions of an index at most (homes scale the hash's top 32 bits)
_ROW = np.dtype([("k", "<i8"), ("s", "<i4")])  # a position: the key and its slot (-1: empty), packed in 12 bytes
_MAX_SLOT = (1 << 31) - 1
_SLOTS_HINT = "; a subtask's key index holds at most 2**31 keys: run the job at a higher parallelism"


class IntKeyIndex:
    """Vectorized open-addressing hash index int64 key -> slot (linear probing, no deletes).

    One packed 12-byte row ``(key, int32 slot)`` per position, so a probe costs one cache
    miss (a row runs into the next line a quarter of the time, a line the hardware fetches
    beside it); an empty position has slot -1 (its key is irrelevant); slots are ``0..2**31 -
    1``. Home positions come from the high bits of a multiplicative hash (keys of one subtask
    share low bits of their key-group hash, and sequential keys must not cluster), scaled to
    the ``cap`` home positions (the top 32 bits times ``cap``, shifted right by 32: any number
    of positions, not only powers of two, so a table holds what it is sized for instead of up
    to twice that). Probing does not wrap around: the table has spare rows after the home
    positions; an insert that would run past the end makes the caller rebuild. Lookups step
    all unresolved keys one position at a time while many remain, then scan windows of
    ``_WINDOW`` positions for the few long probe sequences left.

    Why 12-byte rows (5 M string keys, fresh processes, interleaved): against 16-byte
    ``(int64, int64)`` rows, a quarter less table (203 -> 152 MB at a restore's load of 0.4:
    the restore's peak memory 447 -> 397 MB, its CPU 0.46-0.54 -> 0.42-0.45 s), and lookups
    no slower (a found key 19-24 -> 17-20 ns; the aggregate's fold of 8,192 random keys 110
    ns an event both, 17 -> 16 ns at 100 k keys). Without the C module the numpy twin pays for
    it: numpy gathers 12-byte records at ~4.8 ns a key against ~2.1 for int64 pairs (field
    views by fancy indexing ~7.9, the rows as uint32 words ~8.9), the fold 65-70 -> 82 ns an
    event at 1 M keys. Tried and not taken: 8-byte entries (a
    32-bit tag of the hash and the slot, the key confirmed in the store's keys by slot) halve
    the table and cut a restore's wall time by ~8 %, but a found key then costs a second
    cache miss, and a lookup is memory-bound: 19 -> 38 ns a key (the aggregate's fold 113 ->
    127 ns an event at 5 M random keys, 17 -> 18 ns at 100 k), and a prefetch of the slot's
    key one stage ahead did not win it back. Five keys and their five slots in each 64-byte
    line (12.8 bytes a position; a model in C) built no faster and found keys 15-50 % slower
    (the higher loads that would save memory probe more lines)."""

    __slots__ = ("t", "cap", "size")

    def __init__(self, capacity: int = 1024) -> None:
        self.cap = max(16, int(capacity))
        if self.cap > _MAX_HOMES:
            raise ValueError(f"a key index of {self.cap:,} home positions: at most {_MAX_HOMES:,} (2**32)")
        self.t = self._alloc(self.cap + _WINDOW + self.cap // 64)
        self.size = 0

    @staticmethod
    def _alloc(rows: int) -> np.ndarray:
        t = np.zeros(rows, _ROW)
        # also touches every page now, in order: left to a restore's fill thread to fault in at
        # random while the other threads fault in theirs, the restore's CPU went 0.43 -> 0.7 s
        # (5 M string keys, measured with 8-byte entries on calloc'd memory)
        t["s"] = -1
        return t

    def _homes(self, keys: np.ndarray) -> np.ndarray:
        x = keys.view(np.uint64) * _H1
        x ^= x >> _S31
        x *= _H2
        x >>= _S32
        x *= np.uint64(self.cap)  # < 2**64: both factors are below 2**32 (cap at most 2**32)
        x >>= _S32
        return x.view(np.int64)

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slot of every key, -1 where absent; per key the position where its probe ended:
        for an absent key the first empty position of its probe sequence, or the table length
        when the sequence runs off the end)."""
        if NATIVE is not None:  # one C loop (abscore.native), same results
            keys = np.ascontiguousarray(keys, np.int64)
            out, pos = np.empty(len(keys), np.int64), np.empty(len(keys), np.int64)
            NATIVE.index_lookup(self.t.view(np.uint8), self.cap, keys, out, pos)
            return out, pos
        t = self.t
        rows = len(t)
        pos = self._homes(keys)
        r = np.take(t, pos)
        s = r["s"].astype(np.int64)
        hit = r["k"] == keys
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
                r = np.take(t, p)
                s = r["s"].astype(np.int64)
                hit = r["k"] == keys[idx]
                if hit.any():
                    out[idx[hit]] = s[hit]
                idx = idx[~hit & (s >= 0)]
            else:
                base = pos[idx] + 1
                win = np.minimum(base[:, None] + _WIN, rows - 1)
                rr = np.take(t, win)
                ss = rr["s"].astype(np.int64)
                empty = ss < 0
                match = (rr["k"] == keys[idx][:, None]) & ~empty
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
        if NATIVE is not None:
            if not NATIVE.index_insert(self.t.view(np.uint8), self.cap, np.ascontiguousarray(keys, np.int64),
                                       np.ascontiguousarray(slots, np.int64), np.ascontiguousarray(start, np.int64)):
                return False
            self.size += len(keys)
            return True
        _check_slots(slots)
        t = self.t
        col = t["s"]
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
            t["k"][at[won]] = keys[cand[won]]
            lost = cand[~won]
            pos[lost] = at[~won] + 1
            idx = np.concatenate((moving, lost))
        self.size += len(keys)
        return True

    def build(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Fill an empty index with distinct keys at once: sorted by home position, key ``i``
        lands at ``max(home_i, position_{i-1} + 1)``, i.e. ``i + cummax(home - i)`` (exactly
        where linear probing puts it)."""
        if NATIVE is not None:  # keys in order, each at the first free position from its home
            keys, slots = np.ascontiguousarray(keys, np.int64), np.ascontiguousarray(slots, np.int64)
            while not NATIVE.index_insert(self.t.view(np.uint8), self.cap, keys, slots, None):
                self.t = self._alloc(len(self.t) + self.cap // 8)  # rare: a run past the end
            self.size = len(keys)
            return
        home = self._homes(keys)
        order = _by_home(home, self.cap)
        i = np.arange(len(order))
        pos = i + np.maximum.accumulate(home[order] - i)
        if len(pos) and pos[-1] + 1 + _WINDOW > len(self.t):
            self.t = self._alloc(int(pos[-1]) + 1 + _WINDOW + self.cap // 64)
        _check_slots(slots)
        self.t["k"][pos] = keys[order]
        self.t["s"][pos] = slots[order]
        self.size = len(keys)

    def fill(self, keys: np.ndarray, first: int) -> tuple[np.ndarray, np.ndarray]:
        """Fill an empty index with ``keys[i] -> first + i`` at once, where keys may repeat;
        returns ``(rows, owners)``: the rows whose key an earlier position of its probe sequence
        holds (a lookup of that key finds ``first + owners``, never them). Like :meth:`build`,
        but one sort of packed ``(hash, row)`` words instead of an argsort of the home positions
        (3-5x faster), and equal keys come out adjacent (equal keys have equal hashes)."""
        n = len(keys)
        if NATIVE is not None:  # keys in order: an owner is the first row of its key
            while (got := self.fill_more(keys, first)) is None:
                self.t = self._alloc(len(self.t) + self.cap // 8)  # rare: a run past the end
            self.size = n
            return got
        rb = max(1, (n - 1).bit_length())  # bits of a row
        # four arrays of n words at most: fresh memory is slow to touch (page faults)
        i = np.arange(n, dtype=np.int64)
        x = keys.view(np.uint64) * _H1  # the hash of _homes, before its scaling
        tmp = x >> _S31
        x ^= tmp
        x *= _H2
        cap = np.uint64(self.cap)
        if rb <= _PACK_BITS:  # sort (hash with its low rb bits replaced by the row): by home, equal hashes together
            low = np.uint64((1 << rb) - 1)
            x &= ~low
            x |= i.view(np.uint64)
            x.sort()
            rows = np.bitwise_and(x, low, out=tmp).view(np.int64)
            pos = x >> _S32  # the hash's top 32 bits, untouched by the row: the homes, ascending
            pos *= cap
            pos >>= _S32
            pos = pos.view(np.int64)
            x >>= np.uint64(rb)  # the hash's top 64 - rb bits: equal for equal keys
            prefix = x
        else:  # too many rows to pack: an argsort of the hashes
            rows = np.argsort(x)
            prefix = x[rows]
            pos = (((prefix >> _S32) * cap) >> _S32).view(np.int64)
        pos -= i  # key i lands at max(home_i, position_{i-1} + 1) = i + cummax(home - i)
        np.maximum.accumulate(pos, out=pos)
        pos += i
        if n and pos[-1] + 1 + _WINDOW > len(self.t):
            self.t = self._alloc(int(pos[-1]) + 1 + _WINDOW + self.cap // 64)
        sorted_keys = np.take(keys, rows, out=i)
        if n:
            _check_slots(np.array([first, first + n - 1]))
        self.t["k"][pos] = sorted_keys
        self.t["s"][pos] = rows + first if first else rows
        self.size = n
        # equal keys have equal prefixes, and rows of one prefix are adjacent: check those alone
        near = np.flatnonzero(prefix[1:] == prefix[:-1])
        if not near.size:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        cand = distinct(np.concatenate((near, near + 1)))  # sorted positions (probe order within a prefix)
        ck = sorted_keys[cand]
        order = np.lexsort((cand, ck))  # by key, then by position: each key's owner first
        ck, cand = ck[order], cand[order]
        head = np.empty(len(ck), bool)
        head[:1] = True
        np.not_equal(ck[1:], ck[:-1], out=head[1:])
        owner = cand[np.flatnonzero(head)[np.cumsum(head) - 1]]
        dup = ~head
        return rows[cand[dup]], rows[owner[dup]]

    def fill_more(self, keys: np.ndarray, first: int) -> tuple[np.ndarray, np.ndarray] | None:
        """:meth:`fill` beside the keys already there, in C without the GIL (needs
        :mod:`abscore.native`): ``(rows, owners)`` as :meth:`fill` gives them (relative to
        ``first``; an owner may be a key placed before, at a negative row), or None when a key
        would land past the table's end (the table is then partly filled: build it anew)."""
        n = len(keys)
        keys = np.ascontiguousarray(keys, np.int64)
        rows, owners = np.empty(n, np.int64), np.empty(n, np.int64)
        dups = NATIVE.index_fill(self.t.view(np.uint8), self.cap, keys, first, rows, owners)
        if dups < 0:
            return None
        self.size += n  # the keys given, as fill counts them
        return rows[:dups].copy(), owners[:dups].copy()


def _check_slots(slots: np.ndarray) -> None:
    if len(slots) and (int(slots.min()) < 0 or int(slots.max()) > _MAX_SLOT):
        bad = int(slots[(slots < 0) | (slots > _MAX_SLOT)][0])
        raise ValueError(f"slots: {bad} is not a slot a key index holds (0..2**31 - 1{_SLOTS_HINT})")


_PACK_BITS = 32  # IntKeyIndex.fill packs a row into the low bits of a hash while its top 32 bits (the home) stay


class BackgroundFill:
    """A key index filled by a thread of its own from runs of keys as they come (a restore's
    key groups, while the next ones are read and appended): ``add(keys, first)`` places
    ``keys[i] -> first + i``, runs in the order added; :meth:`finish` waits for the thread and
    gives what ``filler.end()`` gives, or None when a run did not fit (the caller then indexes
    every key after the last one, as without the thread).

    ``filler``: :class:`HashFill` (an :class:`IntKeyIndex`) or :class:`DirectFill` (the dense
    int32 array of :class:`SlotMap`). The thread allocates the index itself (the page faults of
    fresh memory are half the cost of indexing millions of keys) and fills it in C or numpy,
    both without the GIL, so it runs on the other core beside the caller. ``keys`` must stay
    unchanged until :meth:`finish` (the columnar store writes a slot's key once). A fill that
    is never finished (a restore that failed) ends its thread when the object is collected."""

    def __init__(self, filler: Any) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._result: list = []
        self._thread = threading.Thread(target=self._run, args=(filler, self._queue, self._result),
                                        name="abs-index-fill", daemon=True)
        self._thread.start()
        weakref.finalize(self, self._queue.put, None)

    def add(self, keys: np.ndarray, first: int) -> None:
        self._queue.put((keys, first))

    def finish(self) -> Any:
        self._queue.put(None)
        self._thread.join()
        (outcome,) = self._result
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    @staticmethod
    def _run(filler: Any, jobs: queue.SimpleQueue, result: list) -> None:
        fits = True
        try:
            filler.begin()
            while (job := jobs.get()) is not None:
                fits = fits and filler.add(*job)
            result.append(filler.end() if fits else None)
        except BaseException as e:  # noqa: BLE001 - raised again by finish()
            result.append(e)


class HashFill:
    """:class:`BackgroundFill` of an :class:`IntKeyIndex` of ``capacity`` home positions, as
    :meth:`IntKeyIndex.fill` fills one (in C: needs :mod:`abscore.native`); ``end()``: the index
    and the ``(rows, owners)`` of keys an earlier row holds (absolute rows). A run fits while
    the load stays <= 1/2."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    @staticmethod
    def available() -> bool:
        """Whether the C fill is there (:mod:`abscore.native`)."""
        return NATIVE is not None

    def begin(self) -> None:
        self.index = IntKeyIndex(self.capacity)
        self.rows: list = []
        self.owners: list = []

    def add(self, keys: np.ndarray, first: int) -> bool:
        if self.index.size + len(keys) > _MAX_LOAD * self.index.cap:
            return False
        got = self.index.fill_more(keys, first)
        if got is None:
            return False
        self.rows.append(got[0] + first)
        self.owners.append(got[1] + first)
        return True

    def end(self) -> tuple[IntKeyIndex, np.ndarray, np.ndarray]:
        return self.index, _joined(self.rows), _joined(self.owners)


class DirectFill:
    """:class:`BackgroundFill` of :class:`SlotMap`'s dense array over keys ``[0, size)``, as
    :meth:`SlotMap.fill_direct` fills it; ``end()``: ``(direct, keys placed, largest key,
    whether no key came twice)``. A run fits while its keys fall in the range."""

    def __init__(self, size: int) -> None:
        self.size = size

    def begin(self) -> None:
        self.direct = np.full(self.size, -1, np.int32)
        self.n = 0
        self.hi = -1

    def add(self, keys: np.ndarray, first: int) -> bool:
        if not len(keys):
            return True
        lo, hi = int(keys.min()), int(keys.max())
        if lo < 0 or hi >= self.size:
            return False
        self.direct[keys] = np.arange(first, first + len(keys), dtype=np.int32)
        self.n += len(keys)
        self.hi = max(self.hi, hi)
        return True

    def end(self) -> tuple[np.ndarray, int, int, bool]:
        return self.direct, self.n, self.hi, np.count_nonzero(self.direct >= 0) == self.n


def _joined(parts: list) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)
_WINDOW = 32  # positions scanned at once when few probes are left
_WIN = np.arange(_WINDOW)
_STEP_ABOVE = 128  # more unresolved keys than this: step them one position at a time
_MAX_LOAD = 0.5  # keys per home position before the index doubles


class SlotMap:
    """key -> slot. Keys in ``[base, base + len(direct))`` live in a dense int32 array (ids are
    often dense: one gather per lookup, no hashing); the others in :class:`IntKeyIndex`.

    The dense range starts at the smallest key of the first keys placed when they are dense
    enough, and grows (by doubling) to cover new keys below ``base + max(65536, 4 * keys)``,
    so it never costs more than about 32 bytes per key. It is authoritative for its range: when
    it grows, the keys it now covers are copied in (their stale hash entries are never looked
    up again and are dropped at the next hash rebuild)."""

    __slots__ = ("direct", "base", "hash")

    def __init__(self) -> None:
        self.direct: np.ndarray | None = None
        self.base = 0
        self.hash = IntKeyIndex(16)

    def _in_direct(self, keys: np.ndarray) -> np.ndarray:
        hi = min(self.base + len(self.direct), INT64_MAX)
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
            index = IntKeyIndex(int(2 * len(keys) / _MAX_LOAD) if full else h.cap)
            index.build(keys, np.flatnonzero(mask))
            self.hash = index

    @staticmethod
    def direct_range(lo: int, hi: int, n: int) -> tuple[int, int] | None:
        """``(base, length)`` of the dense array :meth:`fill_direct` gives ``n`` keys from
        ``lo`` to ``hi``, or None when they are not dense enough for one."""
        if not n or n >= 2**31:
            return None
        limit = max(_DIRECT_MIN, _DIRECT_PER_KEY * n)
        base = 0 if 0 <= lo < limit else lo
        if hi - base >= limit or base > INT64_MAX - 2 * limit or base < -(2**62):
            return None
        return base, 1 << (hi - base).bit_length()

    def fill_direct(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """Place ``keys[i] -> i`` in an empty map at once when they all fall in the dense range
        :meth:`place` would give them (int keys restored in bulk; ids usually are dense): one
        scatter, where ``place`` scattered them twice and a lookup found them all again (5 M
        keys: 0.5 -> 0.08 s). Returns ``(rows, owners)``: the rows of keys given twice and the
        row each of them finds instead (both empty: every key once); None when the keys do not
        all fall in such a range (place them with :meth:`place`)."""
        n = len(keys)
        if self.direct is not None or self.hash.size or not n:
            return None
        got = self.direct_range(int(keys.min()), int(keys.max()), n)
        if got is None:
            return None
        base, length = got
        direct = np.full(length, -1, np.int32)
        at = keys - base if base else keys
        direct[at] = np.arange(n, dtype=np.int32)
        return self.adopt_direct(direct, base, keys, np.count_nonzero(direct >= 0) == n)

    def adopt_direct(self, direct: np.ndarray, base: int, keys: np.ndarray, once: bool) -> tuple[np.ndarray, np.ndarray]:
        """Take ``direct`` (``keys[i] -> i`` scattered into it, ``once``: no key given twice)
        as this empty map's dense array: :meth:`fill_direct`'s ``(rows, owners)``."""
        self.direct, self.base = direct, base
        if once:  # n positions taken: no key twice
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        found = direct[keys - base if base else keys]  # a key given twice finds one of its rows
        twice = np.flatnonzero(found != np.arange(len(keys)))
        return twice, found[twice].astype(np.int64)

    def _grow_direct(self, all_keys: np.ndarray, new: np.ndarray) -> None:
        if not len(new):
            return
        n = len(all_keys)
        limit = max(_DIRECT_MIN, _DIRECT_PER_KEY * n)
        if self.direct is None:
            base = int(new.min())
            if 0 <= base < limit:
                base = 0  # ids usually start near 0
            if base > INT64_MAX - 2 * limit or base < -(2**62):
                return
            covered = new[new < base + limit]
            if len(covered) * 2 < len(new):  # the new keys are not dense: no dense range (yet)
                return
            self.base = base
            old = 0
        else:
            base = self.base
            old = len(self.direct)
            covered = new[(new >= base + old) & (new < min(base + limit, INT64_MAX))]
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


_DIRECT_MIN = 1 << 16
_DIRECT_PER_KEY = 4


# Sort-based set operations: numpy 2.x's np.unique takes a slow hashing path for integers
# (about 20x slower than a sort for 10,000 int64s).


def distinct(x: np.ndarray) -> np.ndarray:
    """Sorted distinct values."""
    s = np.sort(x)
    if len(s) > 1:
        s = s[np.concatenate(([True], s[1:] != s[:-1]))]
    return s


def distinct_inverse(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct values and, per element of ``x``, the index of its value in them."""
    order = np.argsort(x)  # not stable: 3-4x faster than a stable sort on unordered int64s
    s = x[order]
    flag = np.empty(len(s), bool)
    flag[:1] = True
    np.not_equal(s[1:], s[:-1], out=flag[1:])
    inverse = np.empty(len(x), np.intp)
    inverse[order] = np.cumsum(flag) - 1
    return s[flag], inverse


def first_occurrences(x: np.ndarray) -> np.ndarray:
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


_REP_SORT_BELOW = 64  # fewer values than this: a sort is cheaper than a scratch table


def representatives(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, inverse)``: one row of each distinct value of ``x`` (``x[rows]`` holds every
    distinct value once, in no particular order) and, per element, the index in ``rows`` of
    the row holding its value (``x[rows][inverse] == x``).

    Without a sort: every row writes its index at its value's home in a scratch table of
    about 8 positions a row, and reads back who wrote last; the rows that read a row of
    their own value are resolved (the rows that won keep their value's home: one winner per
    value). The few values whose home another value won (about 6 %) are sorted. 3-4x faster
    than :func:`distinct_inverse` on 8,192 int64s."""
    n = len(x)
    if n < _REP_SORT_BELOW:
        values, inverse = distinct_inverse(x)
        rows = np.empty(len(values), np.intp)
        rows[inverse] = np.arange(n)
        return rows, inverse
    bits = (8 * n - 1).bit_length()
    home = x.view(np.uint64) * _H1
    home >>= np.uint64(64 - bits)
    home = home.view(np.int64)
    at = np.arange(n)
    table = np.empty(1 << bits, np.intp)  # every position read below is written first
    table[home] = at
    rep = table[home]
    ok = x[rep] == x
    rows = np.flatnonzero(rep == at)
    index = table  # reused: row -> its index in rows (read only at rows written just now)
    index[rows] = np.arange(len(rows))
    inverse = np.empty(n, np.intp)
    inverse[ok] = index[rep[ok]]
    rest = np.flatnonzero(~ok)
    if rest.size:
        values, sub = distinct_inverse(x[rest])
        more = np.empty(len(values), np.intp)
        more[sub] = rest
        inverse[rest] = len(rows) + sub
        rows = np.concatenate((rows, more))
    return rows, inverse


_U16 = np.int64(0xFFFF)


def _by_home(home: np.ndarray, cap: int) -> np.ndarray:
    """The order that sorts home positions (``0 <= home < cap``): up to 2**32 positions by two
    stable radix sorts of 16 bits (numpy sorts 16-bit integers by radix), 2-3x faster than an
    argsort of the int64s at 10**5..10**6 keys."""
    if cap > 1 << 32:
        return np.argsort(home)
    order = np.argsort((home & _U16).astype(np.uint16), kind="stable")
    if cap <= 1 << 16:
        return order
    return order[np.argsort((home[order] >> 16).astype(np.uint16), kind="stable")]
