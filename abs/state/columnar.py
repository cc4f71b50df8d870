"""The columnar keyed-state backend of the vectorized aggregate, for int64, string or binary
keys (one kind per store, set by its first keys).

Per subtask, :class:`ColumnarKeyedState` keeps every key of the operator in one *slot*:

* ``keys`` (int64: the key, or the code of a string/binary key, see below), ``kg`` (int16: the
  key group, computed once with
  :func:`abs.keygroups.key_groups` when the key first arrives) and ``ver`` (int64: the epoch of
  the last change, 0 = never changed since restore) are numpy arrays indexed by slot, in
  insertion order, grown by doubling;
* per declared state a numpy accumulator (int64, uint64 for ``uint64`` states, float64 for
  floating states) and two bool arrays: ``valid`` (the value is not null) and ``present`` (the
  key has an entry in that state; an entry may hold a null value, exactly like the dict path);
* :class:`~abs.state.keyindex.SlotMap` (key -> slot): keys of a dense range ``[base, base + len)`` (ids usually
  are dense) are found with one gather in an int32 array; the others in :class:`~abs.state.keyindex.IntKeyIndex`,
  an open-addressing hash index (linear probing, load <= 1/2, one ``(key, slot)`` row per
  position so a probe is one cache miss; all operations vectorized over a batch, new keys of a
  batch claim free positions with a write-then-check, rebuilds place every key at once from
  the sorted home positions);
* string and binary keys: their bytes in ``var`` (:class:`~abs.state.varkeys.VarKeyStore`,
  Arrow's layout in numpy arrays), and in ``keys`` an int64 code (:func:`~abs.state.varkeys.key_codes`:
  a key of up to 7 bytes exactly, a longer one by a 63-bit hash) that the same index maps to a
  slot. Where a code is a hash, one vectorized comparison of the batch's keys with the slots'
  finds the rare rows whose key merely shares its code with another key; those alone go key by
  key through ``collisions`` (:meth:`ColumnarKeyedState.slots_for_var`).

A restore loads a key group the store holds no key of in bulk (:meth:`ColumnarKeyedState._bulk_slots`):
a resolved table holds each key once and keys of distinct key groups differ, so its keys are
appended as they come, without lookups, and indexed once after the last key group
(:meth:`ColumnarKeyedState.finish_restore`: string/binary codes by
:meth:`~abs.state.keyindex.IntKeyIndex.fill`, which also finds the keys that share a code; dense
int keys by one scatter into the dense array, :meth:`~abs.state.keyindex.SlotMap.fill_direct`,
others by one :meth:`~abs.state.keyindex.SlotMap.place`); the store is then the one
:meth:`~ColumnarKeyedState.slots_for_var` / :meth:`~ColumnarKeyedState.slots_for` would have
built, slots aside. A restore of many keys into a fresh store (``_BACKGROUND_FILL_MIN``, from
what its first key group promises) indexes them on another core as they come instead: a thread
(:class:`~abs.state.keyindex.BackgroundFill`) allocates the index and fills it a run of key
groups at a time, without the GIL, while the next key groups are read and appended;
``finish_restore`` hands it the last run and takes its index (5 M keys, with the index:
string keys 0.49 -> 0.28 s, int keys 0.28 -> 0.19 s), or indexes every key itself when they
did not fit what the first key group promised.

Only value states of an integer or floating Arrow type fit (:func:`columnar_descriptors_ok`);
the aggregate operator (:mod:`abs.runtime.aggregate`) folds its batches straight into the
accumulators (:meth:`ColumnarKeyedState.slots_for`, :meth:`~ColumnarKeyedState.slots_for_var`,
:meth:`~ColumnarKeyedState.touch`).
The store has no deletes: an aggregate never removes a key.

Moving key groups while the job runs
------------------------------------
Live reconfiguration (:mod:`abs.reconfig`) moves key groups between subtasks in the store's own
form, with the semantics of :mod:`abs.state.handover`:
:meth:`~ColumnarKeyedState.export_key_group` gives a key group's rows changed since the last
confirmed capture (or all of them) as the delta tables a capture writes;
:meth:`~ColumnarKeyedState.release_key_group` forgets it: its slots stay as they are (slots are
only ever appended, the index has no deletes, and a batch's fast paths need every slot valid and
present), and from then on captures, exports and ``items`` leave out the slots of key groups
the subtask does not own, and a batch with a key of such a key group is refused as routed to
the wrong subtask;
:meth:`~ColumnarKeyedState.adopt_key_group` loads a key group (the resolved chain, then the
handed-over changes): keys of a key group that comes back find their old slots again (cleared
first), the others are appended as a restore appends them, and every key of the key group counts
as changed, so the next capture writes it whole. Once the slots of key groups given away are a
quarter of the store, the next batch that finds no capture pending drops them
(:meth:`~ColumnarKeyedState.maybe_compact`: new arrays and a new index, as after a restore).

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
groups and values (when every slot changed: plain copies of the values, and views of the keys
and key groups, which never change once written); with ``lazy=True`` the deltas are
:class:`~abs.state.capture.SlotsDelta` objects, ``ColumnDelta`` instances like the dict
backend's columnar key groups give: the split by key group (a stable argsort, kept by
:meth:`ColumnarKeyedState.order_by_key_group` while no key is added; each key group's rows
then arrays of their own; string and binary keys also sorted within their key group, as
storage writes them) happens in the asynchronous part, a chunk of key groups at a time
(:meth:`~abs.state.capture.FrozenSlots.chunk`), when a delta of the chunk is first encoded
or pickled for the worker's writer process, which receives a plain ``ColumnDelta`` of one key
group's rows and encodes it as it does the dict backend's, while the worker cuts the next
chunk. The tables have exactly the
schema the dict backend writes for the same typed ``ValueState`` (``key`` int64, string or
binary, ``value`` of the declared type, ``op`` int8 not null, the ``abs.*`` metadata), so
storage, restore and inspection do not see a difference and snapshots restore into either
path.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from abs.errors import StateError
from abs.keygroups import KeyGroupRange, KeyGroupSet, key_groups

from .capture import FrozenSlots, SlotsDelta, group_bounds
from .encoding import (ENCODING_ARROW, META_KEY_ENCODING, META_STATE_KIND, META_VALUE_ENCODING, OP_DELETE,
                       check_restore_table)
from .keyindex import INT64_MAX, BackgroundFill, DirectFill, HashFill, IntKeyIndex, SlotMap, distinct, distinct_inverse, representatives
from .varkeys import Gathered, VarKeyStore, arrow_buffers, key_codes, var_key_kind

if TYPE_CHECKING:
    from .dict_backend import KeyedStateBackend

__all__ = ["ColumnarKeyedState", "StateColumn", "acc_dtype", "columnar_descriptors_ok", "numpy_int64"]


def acc_dtype(t: pa.DataType) -> np.dtype | None:
    """numpy accumulator of a state of Arrow type ``t`` (None: not columnar)."""
    if pa.types.is_floating(t):
        return np.dtype(np.float64)
    if pa.types.is_uint64(t):
        return np.dtype(np.uint64)
    if pa.types.is_integer(t):
        return np.dtype(np.int64)
    return None


class StateColumn:
    """Accumulators of one declared state."""

    __slots__ = ("descriptor", "name", "arrow_type", "dtype", "init", "values", "valid", "present",
                 "all_valid", "all_present", "schema", "bound")

    def __init__(self, descriptor: Any, init: Any, capacity: int) -> None:
        self.descriptor = descriptor
        self.name = descriptor.name
        self.arrow_type = descriptor.value_arrow_type()
        self.dtype = acc_dtype(self.arrow_type)
        self.init = init
        self.values = np.full(capacity, init, self.dtype)
        self.valid = np.zeros(capacity, bool)
        self.present = np.zeros(capacity, bool)
        self.all_valid: bool | None = True  # every slot < n is valid (None: unknown)
        self.all_present: bool | None = True  # every slot < n is present (None: unknown)
        self.bound: float | None = 0.0  # >= every |value| of an int64 sum (None: unknown)
        self.schema = pa.schema(
            [pa.field("key", pa.int64()), pa.field("value", self.arrow_type), pa.field("op", pa.int8(), nullable=False)],
            metadata={META_KEY_ENCODING: ENCODING_ARROW, META_VALUE_ENCODING: ENCODING_ARROW,
                      META_STATE_KIND: descriptor.kind.encode()},
        )

    def grow(self, capacity: int, n: int) -> None:
        zero = not np.full(1, self.init, self.dtype).view(np.uint8).any()
        # zeros: pages are touched when written, not all at once (a restore of millions of keys)
        values = np.zeros(capacity, self.dtype) if zero else np.full(capacity, self.init, self.dtype)
        values[:n] = self.values[:n]
        valid = np.zeros(capacity, bool)
        valid[:n] = self.valid[:n]
        present = np.zeros(capacity, bool)
        present[:n] = self.present[:n]
        self.values, self.valid, self.present = values, valid, present


def columnar_descriptors_ok(descriptors: Any) -> bool:
    return all(d.kind == "value" and d.type is not None and acc_dtype(d.type) is not None for d in descriptors)


class ColumnarKeyedState:
    """Keyed state of one aggregate subtask for int64, string or binary keys; the snapshot
    API (``capture``, ``capture_full``, ``confirm``, ``abort``, ``restore``) of
    :class:`KeyedStateBackend` with the same semantics and the same table encoding (see the
    module docstring)."""

    def __init__(self, operator_uid: str, descriptors: Any, max_parallelism: int,
                 key_group_range: KeyGroupRange, inits: dict | None = None) -> None:
        self.operator_uid = operator_uid
        self.max_parallelism = max_parallelism
        self.key_group_range = KeyGroupSet.of(max_parallelism, key_group_range)
        self.n = 0
        self.capacity = 1024
        self.keys = np.zeros(self.capacity, np.int64)
        self.kg = np.zeros(self.capacity, np.int16)
        self.ver = np.zeros(self.capacity, np.int64)
        self.kg_counts = np.zeros(max_parallelism, np.int64)  # keys per key group
        inits = inits or {}
        self.columns: dict[str, StateColumn] = {
            d.name: StateColumn(d, inits.get(d.name, 0), self.capacity) for d in descriptors
        }
        self.map = SlotMap()
        self.key_kind: str | None = None  # "int", "string" or "binary": set by the first keys
        self.var: VarKeyStore | None = None  # string/binary keys by slot (``keys``: their codes)
        self.collisions: dict = {}  # str/bytes key -> slot, for every key whose code another key has
        self.epoch = 1
        self.confirmed_epoch = 0
        self.dirty: dict[int, list[np.ndarray]] = {1: []}  # epoch -> slots first changed in it
        self._scan_until = 0  # lists of epochs <= this were dropped: scan while unconfirmed
        self._pending: dict[int, int] = {}  # checkpoint id -> epoch it closed, ascending
        self._last_captured: int | None = None
        self._last_confirmed: int | None = None
        self._by_kg: tuple | None = None  # (n, order, keys, bounds) of slots 0..n-1 (order_by_key_group)
        # restored in bulk (load_checked): slots from here on are not in the index yet
        self._unindexed: int | None = None
        self._bulk: dict[int, tuple[int, int]] = {}  # key group -> its slots, of the bulk not indexed yet
        # the keys of a large bulk into a fresh store: indexed by a thread of their own as they
        # come (BackgroundFill), from the first slot not handed to it yet
        self._fill: BackgroundFill | None = None
        self._fill_from = 0
        self._restore_bound: int | None = None  # keys a restore brings at most (expect_restore)
        # a key group left this subtask (release_key_group): its slots stay, in no state, until it
        # comes back; captures and lookups then check ownership (see "Moving key groups")
        self._released = False

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

    @property
    def key_rows(self) -> Any:
        """The keys by slot: ``keys`` (int64), or the :class:`~abs.state.varkeys.VarKeyStore`
        of string/binary keys (both give rows with ``[:n]`` and ``[slots]``)."""
        return self.keys if self.var is None else self.var

    def takes(self, kind: str) -> bool:
        """Whether keys of ``kind`` (``"int"``, ``"string"``, ``"binary"``) fit: a store holds
        the one kind its first keys had."""
        return self.key_kind is None or self.key_kind == kind

    def _set_kind(self, kind: str) -> None:
        if self.key_kind is None:
            self.key_kind = kind
            if kind != "int":
                self.var = VarKeyStore(kind, self.capacity)
        elif self.key_kind != kind:  # callers check takes() first
            raise StateError(
                f"operator {self.operator_uid!r}: {kind} keys in a columnar store of {self.key_kind} "
                "keys; move the state to the dict backend first (AggregateBackend.migrate_to_dict)"
            )

    def _col(self, name: str) -> StateColumn:
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
        if self._released:
            sel &= self.key_group_range.mask[self.kg[: self.n]]
        slots = np.flatnonzero(sel)
        vals = col.values[slots].tolist()
        valid = col.valid[slots].tolist()
        return iter([(k, v if ok else None) for k, v, ok in zip(self.key_rows[slots].tolist(), vals, valid)])

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
        return distinct(np.concatenate(lists))

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

    def _append(self, keys: np.ndarray, kgs: np.ndarray, start: np.ndarray | None, present: bool,
                index: bool = True) -> np.ndarray:
        """New slots for distinct keys absent from the index (``start``: where their lookup
        ended); ``keys``: the int64 keys, or the codes of string/binary keys already appended
        to ``var``. ``index=False``: not placed in the index (a code another key holds there)."""
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
        if index:
            self.map.place(self.keys[:n1], keys, slots, start)
        return slots

    def slots_for(self, keys: np.ndarray) -> np.ndarray:
        """Slot of every key of a batch (int64 array), inserting new keys (present in every
        state; their key groups must be in this subtask's range)."""
        def new_key_groups(new: np.ndarray) -> np.ndarray:
            kgs = key_groups(new, self.max_parallelism)
            self._check_range(kgs, lambda i: int(new[i]))
            return kgs.astype(np.int16)

        return self._int_slots(keys, new_key_groups, present=True)

    def _int_slots(self, keys: np.ndarray, key_groups_of: Any, present: bool) -> np.ndarray:
        """Slot of every int64 key, appending the keys not there yet (``key_groups_of(new)``:
        their key groups)."""
        self._set_kind("int")
        if self._unindexed is not None:
            self.finish_restore()
        slots, ends = self.map.find(keys)
        miss = slots < 0
        if miss.any():
            new, inverse = distinct_inverse(keys[miss])
            start = None
            if ends is not None:
                start = np.empty(len(new), np.int64)
                start[inverse] = ends[miss]  # duplicates of a key share its probe end
            slots[miss] = self._append(new, key_groups_of(new), start, present=present)[inverse]
        return slots

    def _check_range(self, kgs: np.ndarray, key_of: Any) -> None:
        rng = self.key_group_range
        bad = ~rng.mask[kgs]
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise StateError(
                f"operator {self.operator_uid!r}: key {key_of(i)!r} belongs to key group "
                f"{int(kgs[i])}, outside this subtask's range {rng}; the record was routed to "
                "the wrong subtask (routing table and key-group range disagree)"
            )

    def slots_for_var(self, arr: pa.Array, *, kg: int | None = None) -> np.ndarray:
        """Slot of every key of a null-free string or binary array, inserting new keys.

        The index maps each key's code (:func:`~abs.state.varkeys.key_codes`: a key of up to
        7 bytes exactly, a longer one by a 63-bit hash) to a slot. Where a code is a hash, one
        vectorized comparison of the slots' stored keys with the batch's finds the rows whose
        key is not the key of that slot: another key has the same hash (a true collision).
        Only those rows go key by key, through ``collisions``, which holds every key whose code
        another key shares (the key the index found included), so they stay exact however many
        keys collide. ``kg`` None: a batch (new keys present in every state, their key groups,
        from the stable hash, checked against the range); else a restore into key group ``kg``
        (new keys present in no state until the caller loads them)."""
        kind = var_key_kind(arr.type)
        self._set_kind(kind)
        if self._unindexed is not None:
            self.finish_restore()
        codes, hashed = key_codes(arr)
        slots, ends = self.map.find(codes)
        miss = slots < 0
        if miss.any():
            rows = np.flatnonzero(miss)
            reps, inverse = representatives(codes[rows])
            first = rows[reps]  # a row of each new code
            new = codes[first]
            start = None if ends is None else ends[first]  # rows of one code share its probe end
            new_keys = arr.take(pa.array(first))
            if kg is None:
                kgs = key_groups(new_keys, self.max_parallelism).astype(np.int16)
                self._check_range(kgs, lambda i: new_keys[i].as_py())
            else:
                kgs = np.full(len(new), kg, np.int16)
            self.var.append(new_keys)
            slots[rows] = self._append(new, kgs, start, present=kg is None)[inverse]
        if hashed is not None:
            check = None if hashed.all() else np.flatnonzero(hashed)
            mine = arr if check is None else arr.take(pa.array(check))
            stored = self.var.arrow_view().take(pa.array(slots if check is None else slots[check]))
            same = pc.equal(stored, mine.cast(stored.type))
            if same.false_count:
                bad = np.flatnonzero(~same.to_numpy(zero_copy_only=False))
                self._collided(arr, codes, slots, bad if check is None else check[bad], kg)
        return slots

    def _collided(self, arr: pa.Array, codes: np.ndarray, slots: np.ndarray, rows: np.ndarray, kg: int | None) -> None:
        """Give ``rows`` (their key differs from the key of the slot their code found) the slot
        of their own key, key by key (see :meth:`slots_for_var`)."""
        coll = self.collisions
        for i, key in zip(rows.tolist(), arr.take(pa.array(rows)).to_pylist()):
            s = coll.get(key)
            if s is None:
                owner = int(slots[i])  # the slot of another key with the same code
                coll.setdefault(self.var.key(owner), owner)
                one = pa.array([key], arr.type)
                g = kg
                if g is None:
                    g = int(key_groups(one, self.max_parallelism)[0])
                    self._check_range(np.array([g]), lambda _i: key)
                self.var.append(one)
                s = int(self._append(codes[i:i + 1], np.array([g], np.int16), None, kg is None, index=False)[0])
                coll[key] = s
            slots[i] = s

    def order_by_key_group(self, n: int) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int, int]]]:
        """Slots ``0 .. n-1`` stably sorted by key group: ``(order, keys[order], [(start, end,
        key group), ...])``, string and binary keys as a :class:`~abs.state.varkeys.Gathered`
        (gathered, each key group's sorted, a chunk at a time as captures cut them). Kept until
        a slot is added (a slot's key and key group never change once written), so full
        captures of a store whose keys stay do not sort again: 12 bytes per key (int32 order,
        the sorted keys; string keys: 4 more, their sorted order). Safe to call from the uploader thread
        while the task thread appends (only slots below ``n`` are read)."""
        got = self._by_kg
        if got is None or got[0] != n:
            kg = self.kg[:n]
            order = np.argsort(kg, kind="stable")
            if n < 2**31:
                order = order.astype(np.int32)
            # string/binary keys: gathered a chunk at a time, when a capture cuts it (varkeys.Gathered)
            keys = self.keys[:n][order] if self.var is None else Gathered(self.var.view(n), order)
            order.flags.writeable = False  # shared by the captures' rows
            if isinstance(keys, np.ndarray):
                keys.flags.writeable = False
            got = self._by_kg = (n, order, keys, group_bounds(kg[order]))
        return got[1], got[2], got[3]

    def touch(self, slots: np.ndarray) -> None:
        """Record that ``slots`` changed in the current epoch (before their values change): a
        slot of a key group this subtask released is refused, as routed to the wrong subtask."""
        epoch = self.epoch
        ver = self.ver[slots]
        if self._released and len(ver) and ver.min() == _RELEASED:
            s = int(slots[int(np.flatnonzero(ver == _RELEASED)[0])])
            self._check_range(self.kg[s:s + 1], lambda _i: self.key_rows[s:s + 1].tolist()[0])
        fresh = slots[ver != epoch]
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
        :class:`SlotsDelta` objects (``ColumnDelta`` instances) that do the split by key group
        and the Arrow encoding later (the asynchronous part; see the module docstring)."""
        slots = self._live(self.changed_since_confirmed())
        self._close_epoch(checkpoint_id)
        frozen = FrozenSlots(self, slots)
        if not lazy:
            return frozen.encode()
        kgs = frozen.key_groups()
        return {name: {kg: SlotsDelta(frozen, name, kg) for kg in kgs} for name in self.columns}

    def capture_full(self, checkpoint_id: int) -> dict[str, dict[int, pa.Table]]:
        """Every non-empty key group's full contents (counts as a capture)."""
        self._close_epoch(checkpoint_id)
        return FrozenSlots(self, self._live(np.arange(self.n, dtype=np.int64))).encode()

    def _live(self, slots: np.ndarray) -> np.ndarray:
        """``slots`` without those of key groups this subtask does not own (nothing to filter
        while it released none) nor slots that hold no entry of any state (a key group that
        came back without some of its old keys)."""
        if not self._released or not len(slots):
            return slots
        return slots[self.key_group_range.mask[self.kg[slots]] & self._held(slots)]

    def _held(self, slots: Any) -> np.ndarray:
        """Per slot of ``slots`` (an index array or a slice): it holds an entry of some state."""
        held = np.zeros(len(self.kg[slots]), bool)
        for c in self.columns.values():
            held |= c.present[slots]
        return held

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
        columnar store (typed numeric values, keys of the store's kind: int, string or binary
        without nulls), False when it needs the dict path."""
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
        if meta.get(META_KEY_ENCODING, ENCODING_ARROW) != ENCODING_ARROW or meta.get(META_VALUE_ENCODING, ENCODING_ARROW) != ENCODING_ARROW:
            return False
        kt = table.schema.field("key").type
        vt = table.schema.field("value").type
        kind = "int" if pa.types.is_integer(kt) else var_key_kind(kt)
        if kind is None or not self.takes(kind) or table.column("key").null_count:
            return False
        if pa.types.is_uint64(kt) and table.num_rows and pc.max(table.column("key")).as_py() > INT64_MAX:
            return False
        if pa.types.is_integer(vt):
            return True
        return pa.types.is_floating(vt) and col.dtype.kind == "f"

    def restore(self, state_name: str, kg: int, table: pa.Table, *, verify: bool = False) -> None:
        """Upsert a resolved table of key group ``kg`` into state ``state_name``, after the
        checks of :meth:`check_restore_table`; a table that does not fit the columnar store
        (keys that are not integers, pickled or non-numeric values) is refused (restore it
        through :class:`~abs.state.aggregate_backend.AggregateBackend`, which moves to the
        dict backend for it)."""
        if not self.check_restore_table(state_name, kg, table):
            raise StateError(
                f"operator {self.operator_uid!r}, state {state_name!r}, key group {kg}: the table "
                f"(key {table.schema.field('key').type}, value {table.schema.field('value').type}, "
                "encodings in its metadata) does not fit the columnar store, which holds int64, "
                f"string or binary keys (this one: {self.key_kind or 'none yet'}) with numeric values; "
                "restore it through AggregateBackend, which moves such state to the dict backend"
            )
        self.load_checked(state_name, kg, table, verify=verify)

    def load_checked(self, state_name: str, kg: int, table: pa.Table, *, verify: bool = False) -> None:
        """:meth:`restore` of a table :meth:`check_restore_table` accepted: restored keys are
        not dirty; new keys are recorded in key group ``kg`` (``verify=True`` checks that
        every key hashes to it)."""
        col = self._col(state_name)
        if not table.num_rows:
            return
        keycol = one_array(table.column("key"))
        var = var_key_kind(keycol.type) is not None
        keys = keycol if var else numpy_int64(keycol)
        if verify:
            actual = key_groups(keys, self.max_parallelism)
            wrong = np.flatnonzero(actual != kg)
            if wrong.size:
                k = keys[int(wrong[0])]
                k = k.as_py() if var else int(k)
                raise StateError(
                    f"operator {self.operator_uid!r}, state {state_name!r}, key group {kg}: key "
                    f"{k!r} belongs to key group {int(actual[wrong[0]])}; the snapshot file is in "
                    "the wrong key group (corrupt or re-keyed with another max_parallelism)"
                )
        slots = self._bulk_slots(kg, keys)
        if slots is None and var:
            slots = self.slots_for_var(keys, kg=kg)
        elif slots is None:
            slots = self._int_slots(keys, lambda new: np.full(len(new), kg, np.int16), present=False)
        self._load_values(col, slots, one_array(table.column("value")))

    def restore_slices(self, state_name: str, table: pa.Table, parts: Any) -> bool:
        """:meth:`load_checked` of ``table.slice(offset, rows)`` into key group ``kg`` for each
        ``(kg, offset, rows)`` of ``parts`` (the key groups of one shared range of a snapshot,
        :meth:`SnapshotStore.read_range`), as few bulks as the parts' rows allow: each run of
        parts whose rows follow one another in the table is appended at once (fresh key
        groups), or found at once in the slots another state's restore gave them. True when
        done; False, with nothing changed, when the table is not one :meth:`check_restore_table`
        accepts without a doubt (no op column, no null or uint64 keys) or a key group is
        neither fresh nor so restored: the caller then restores key group by key group (which
        raises what it raises)."""
        col = self.columns.get(state_name)
        if col is None or len(parts) < 2 or not self._slices_fit(col, table):
            return False
        owned = self.key_group_range
        runs: list[list] = []  # [start, end, [(kg, rows)], slots or None (fresh)]
        for kg, offset, rows in sorted(parts, key=lambda p: p[1]):
            if type(kg) is not int or kg not in owned:
                return False
            if runs and runs[-1][1] == offset:
                runs[-1][1] += rows
                runs[-1][2].append((kg, rows))
            else:
                runs.append([offset, offset + rows, [(kg, rows)], None])
        keycol = one_array(table.column("key"))
        var = var_key_kind(keycol.type) is not None
        keys = keycol if var else numpy_int64(keycol)
        for run in runs:
            start, end, groups = run[0], run[1], run[2]
            got = [self._bulk.get(kg) for kg, rows in groups if rows]
            if all(g is None for g in got):
                if any(self.kg_counts[kg] for kg, _rows in groups):
                    return False
                continue
            if any(g is None for g in got) or any(a[1] != b[0] for a, b in zip(got, got[1:])) \
                    or not self._same_keys(got[0][0], got[-1][1], keys[start:end]):
                return False
            run[3] = slice(got[0][0], got[-1][1])
        varr = one_array(table.column("value"))
        for start, end, groups, slots in runs:
            if start == end:
                continue  # key groups without rows: load_checked records nothing of them either
            if slots is None:
                slots = self._bulk_append(keys[start:end], groups)
            self._load_values(col, slots, varr.slice(start, end - start))
        return True

    def _slices_fit(self, col: StateColumn, table: pa.Table) -> bool:
        """Whether ``table`` passes :meth:`check_restore_table` into the columnar store
        whatever key group it is of (see :meth:`restore_slices`)."""
        meta = table.schema.metadata or {}
        names = table.schema.names
        kind = meta.get(META_STATE_KIND)
        if (kind is not None and kind.decode() != col.descriptor.kind) or "key" not in names or "value" not in names \
                or "op" in names:
            return False
        if meta.get(META_KEY_ENCODING, ENCODING_ARROW) != ENCODING_ARROW \
                or meta.get(META_VALUE_ENCODING, ENCODING_ARROW) != ENCODING_ARROW:
            return False
        kt = table.schema.field("key").type
        vt = table.schema.field("value").type
        key_kind = "int" if pa.types.is_integer(kt) else var_key_kind(kt)
        if key_kind is None or not self.takes(key_kind) or table.column("key").null_count or pa.types.is_uint64(kt):
            return False
        return pa.types.is_integer(vt) or (pa.types.is_floating(vt) and col.dtype.kind == "f")

    def _load_values(self, col: StateColumn, slots: slice, varr: pa.Array) -> None:
        """The values ``varr`` of restored keys into ``slots`` of state ``col``."""
        if varr.null_count:
            valid = varr.is_valid().to_numpy(zero_copy_only=False)
            vals = varr.fill_null(0).to_numpy(zero_copy_only=False).astype(col.dtype)
            vals[~valid] = col.init
        else:
            valid = True
            vals = varr.to_numpy(zero_copy_only=False)  # the assignment casts: no copy of its own
        col.values[slots] = vals
        col.valid[slots] = valid
        col.present[slots] = True
        for c in self.columns.values():
            c.all_valid = None
            c.all_present = None
            c.bound = None

    def _bulk_slots(self, kg: int, arr: pa.Array | np.ndarray) -> slice | None:
        """Slots of the keys of a table restored into key group ``kg`` (a string/binary array,
        or int64 keys in numpy) when they can be loaded in bulk, without the index (None: they
        cannot, use slots_for_var or _int_slots).

        A key group the store holds no key of (a restore into a fresh store, the common case):
        its keys (string/binary ones with their codes) are appended as they come, and indexed once, by
        :meth:`finish_restore`, after the last key group (a resolved table holds each key once,
        and keys of distinct key groups differ, so there is nothing to look up meanwhile).
        Another state of a key group loaded so, with the same keys in the same order (the
        store writes every state of a key group from the same slots): that key group's slots."""
        ints = isinstance(arr, np.ndarray)
        got = self._bulk.get(kg)
        if got is not None:
            lo, hi = got
            return slice(lo, hi) if self._same_keys(lo, hi, arr) else None
        kind = "int" if ints else var_key_kind(arr.type)
        if self.kg_counts[kg] or not self.takes(kind):
            return None
        return self._bulk_append(arr, [(kg, len(arr))])

    def _same_keys(self, lo: int, hi: int, arr: pa.Array | np.ndarray) -> bool:
        """Whether slots ``lo`` to ``hi`` hold the keys ``arr`` (int64 numpy, or a string/binary
        array), in that order."""
        if hi - lo != len(arr):
            return False
        if isinstance(arr, np.ndarray):
            return bool(np.array_equal(self.keys[lo:hi], arr))
        offsets, data = arrow_buffers(arr)
        store = self.var
        mine = store.offsets[lo:hi + 1]
        a, b = int(offsets[0]), int(offsets[-1])
        return not (b - a != mine[-1] - mine[0] or not np.array_equal(offsets - a, mine - mine[0])
                    or not np.array_equal(data[a:b], store.data[mine[0]:mine[-1]]))

    def _bulk_append(self, arr: pa.Array | np.ndarray, groups_rows: list[tuple[int, int]]) -> slice:
        """Append the keys ``arr`` of fresh key groups (``(kg, rows)`` in ``arr``'s order) in
        bulk, unindexed (see :meth:`_bulk_slots`): their slots."""
        ints = isinstance(arr, np.ndarray)
        self._set_kind("int" if ints else var_key_kind(arr.type))
        n0 = self.n
        n1 = n0 + len(arr)
        if not n0:  # the first key groups of a restore: room for as many in each key group of the range
            groups = int(self.key_group_range.mask.sum())
            first = -(-len(arr) // max(len(groups_rows), 1))  # their mean
            guess = max(n1, first * groups + first // 8 * int(groups ** 0.5))
            if self._restore_bound is not None:
                guess = max(n1, min(guess, self._restore_bound))
            if guess > self.capacity:
                self._grow(guess)
            if not ints:
                offsets, _ = arrow_buffers(arr, wide=False)
                self.var.reserve(guess, int(offsets[-1] - offsets[0]) * guess // max(n1, 1))
            if guess >= _BACKGROUND_FILL_MIN and self.map.direct is None and not self.map.hash.size:
                self._fill_from = 0
                if not ints and HashFill.available():  # the hash index in C
                    self._fill = BackgroundFill(HashFill(int(_BULK_ROOM * guess)))
                elif ints and len(arr) and (dense := SlotMap.direct_range(int(arr.min()), int(arr.max()), guess)) \
                        and dense[0] == 0:  # ids from near 0: their dense array (other ranges: after the last key group)
                    self._fill = BackgroundFill(DirectFill(dense[1]))
        if n1 > self.capacity:
            self._grow(n1)
        # _append without its writes of the defaults (ver 0, values init, valid and present
        # False), which slots past n hold already (grow fills them so, nothing writes there)
        if ints:
            self.keys[n0:n1] = arr
        else:
            self.var.append(arr)
            key_codes(arr, out=self.keys[n0:n1], rows=False)  # written in place: no array of codes to copy
        at = n0
        for kg, rows in groups_rows:
            if rows:
                self.kg[at:at + rows] = kg
                self.kg_counts[kg] += rows
                self._bulk[kg] = (at, at + rows)
                at += rows
        self.n = n1
        if self._unindexed is None:
            self._unindexed = n0
        if self._fill is not None and n1 - self._fill_from >= _FILL_RUN:  # runs of a few key groups: the C fill lets the GIL go from 64 k keys on
            self._fill.add(self.keys[self._fill_from:n1], self._fill_from)
            self._fill_from = n1
        return slice(n0, n1)

    def expect_restore(self, keys: int) -> None:
        """A restore about to begin brings at most ``keys`` keys (the rows of its chains' files:
        the runtime counts them from the manifest). A bulk into a fresh store is sized from its
        first key group (as many in each key group it owns), and never larger than this: the
        first key group of a skewed key set (all keys in one key group) made room, an index
        thread's table included, for as many in every other key group (300 k string keys in
        one of 128 key groups: ~1.6 GB, where 0.1 GB held them)."""
        self._restore_bound = max(0, int(keys))

    def finish_restore(self) -> None:
        """Index the keys restored in bulk (:meth:`_bulk_slots`); slot lookups call it first,
        the runtime after the last key group of a restore. String/binary keys whose code
        another key has go to ``collisions``, as :meth:`slots_for_var` puts them there; a key
        restored twice (in two key groups, or twice in one table: a corrupt snapshot) is
        refused."""
        self._restore_bound = None
        lo = self._unindexed
        if lo is None:
            return
        n = self.n
        codes = self.keys[lo:n]
        self._bulk = {}
        if self.var is None:
            self._index_int_bulk(lo, n)
            return
        built = self._finish_fill(lo, n)  # None: no thread, or more keys than its index was sized for
        if built is not None:
            self.map.hash, rows, owners = built
            self._unindexed = None
        elif lo == 0 and self.map.direct is None and not self.map.hash.size:
            index = IntKeyIndex(int(_BULK_ROOM * n))
            rows, owners = index.fill(codes, 0)
            self.map.hash = index
            self._unindexed = None
        else:  # keys there before the bulk: look the new ones up, as slots_for_var does
            slots, ends = self.map.find(codes)
            miss = np.flatnonzero(slots < 0)
            new, inverse = distinct_inverse(codes[miss])
            first = np.empty(len(new), np.int64)
            first[inverse] = miss  # a row of each new code: the index gets that one
            start = None if ends is None else ends[first]
            self._unindexed = None
            if len(new):
                self.map.place(self.keys[:n], new, first + lo, start)
            slots[miss] = first[inverse] + lo
            rows = np.flatnonzero(slots != np.arange(lo, n))
            owners = slots[rows]
            rows = rows + lo
        if len(rows):
            self._bulk_collided(rows, owners)

    def _finish_fill(self, lo: int, n: int) -> Any:
        """What the restore's index thread built (:class:`BackgroundFill`), after handing it the
        last run of slots up to ``n``; None when there is none (or it did not fit), or the bulk
        did not start at slot 0 (the thread's index is then dropped)."""
        fill, self._fill = self._fill, None
        if fill is None or lo:
            return None
        if self._fill_from < n:
            fill.add(self.keys[self._fill_from:n], self._fill_from)
        return fill.finish()

    def _index_int_bulk(self, lo: int, n: int) -> None:
        """:meth:`finish_restore` of int keys: the index places them at once (dense ones in
        its direct range), then finds them all again: a key restored twice finds another slot."""
        keys = self.keys[lo:n]
        placed = None
        if (got := self._finish_fill(lo, n)) is not None:  # dense ids: the thread's array, if they all fell in it
            direct, placed_n, hi, once = got
            if placed_n == n and SlotMap.direct_range(0, hi, n) == (0, len(direct)):
                placed = self.map.adopt_direct(direct, 0, keys, once)
        if placed is None and not lo:  # a fresh store, dense keys: one scatter
            placed = self.map.fill_direct(keys)
        if placed is not None:
            self._unindexed = None
            twice, owners = placed
            if len(twice):
                s = int(twice[0])
                raise self._restored_twice(int(self.keys[s]), s, int(owners[0]))
            return
        slots = np.arange(lo, n, dtype=np.int64)
        found, ends = self.map.find(keys)
        self._unindexed = None
        known = found >= 0
        if not known.any():
            self.map.place(self.keys[:n], keys, slots, ends)
            found, _ = self.map.find(keys)
            known = found != slots
        if known.any():
            s = lo + int(np.flatnonzero(known)[0])
            other = int(found[s - lo]) if found[s - lo] >= 0 and found[s - lo] != s else s
            raise self._restored_twice(int(self.keys[s]), s, other)

    def _restored_twice(self, key: Any, slot: int, other: int) -> StateError:
        """The error of a restore that found ``key`` twice (slots ``slot`` and ``other``)."""
        g, h = sorted((int(self.kg[other]), int(self.kg[slot])))
        where = f"key group {g}" if g == h else f"key groups {g} and {h}"
        return StateError(
            f"operator {self.operator_uid!r}: restore: key {key!r} is in the restored state twice ({where}); "
            "the snapshot is corrupt or was re-keyed with another max_parallelism; restore another "
            "checkpoint or repair this one"
        )

    def _bulk_collided(self, rows: np.ndarray, owners: np.ndarray) -> None:
        """Slots ``rows`` share their code with slots ``owners`` (which the index finds):
        both keys go to ``collisions``; the same key twice is refused."""
        coll = self.collisions
        var = self.var
        for s, o in zip(rows.tolist(), owners.tolist()):
            key, owner_key = var.key(s), var.key(o)
            if key == owner_key or coll.get(key, s) != s:
                raise self._restored_twice(key, s, o if key == owner_key else coll[key])
            coll.setdefault(owner_key, o)
            coll[key] = s

    def refresh_flags(self) -> None:
        n = self.n
        for c in self.columns.values():
            if c.all_valid is None:
                c.all_valid = bool(c.valid[:n].all())
            if c.all_present is None:
                c.all_present = bool(c.present[:n].all())

    # ------------------------------------------------------------------ moving key groups
    def export_key_group(self, kg: int, *, full: bool) -> dict[str, pa.Table]:
        """State name -> delta table of key group ``kg``: its keys changed since the last
        confirmed capture, or with ``full`` every key (states with no row are left out); the
        tables a capture writes (:mod:`abs.state.handover`)."""
        self._own(kg, "export of")
        n = self.n
        sel = self.kg[:n] == kg
        if not full:
            sel &= self.ver[:n] > self.confirmed_epoch
        slots = self._live(np.flatnonzero(sel))
        if not len(slots):
            return {}
        return {name: by_kg[kg] for name, by_kg in FrozenSlots(self, slots).encode().items()
                if kg in by_kg and by_kg[kg].num_rows}

    def release_key_group(self, kg: int) -> None:
        """Forget key group ``kg``: once the caller dropped it from the owned set, its slots
        are left out of captures, exports and :meth:`items`, and its keys are refused
        (captures taken before still write it, as in :func:`abs.state.handover.release_key_group`)."""
        self._own(kg, "release of")
        # the slots keep their values and flags (the batches' fast paths need every slot valid
        # and present): ownership leaves them out of captures, exports and items (_live), the
        # version _RELEASED makes touch refuse them, and adopt_key_group clears them should the
        # key group come back
        self.ver[: self.n][self.kg[: self.n] == kg] = _RELEASED
        self._released = True

    def fits(self, kg: int, tables: Any) -> bool:
        """Whether every table of ``tables`` (``(state name, table)`` pairs) fits the columnar
        store (:meth:`check_restore_table`) and holds no delete (an aggregate writes none; the
        dict backend applies a delta that has some); ``kg`` must be owned."""
        for name, table in tables:
            if "op" in table.schema.names:
                if table.num_rows and pc.any(pc.equal(table.column("op"), OP_DELETE)).as_py():
                    return False
                table = table.drop_columns(["op"])
            if not self.check_restore_table(name, kg, table):
                return False
        return True

    def adopt_key_group(self, kg: int, base: Any, changes: Any) -> None:
        """Load key group ``kg`` (already added to the owned set; :meth:`fits` said yes):
        ``base`` (state -> resolved table) then ``changes`` (state -> delta table with ``op``),
        in that order; every key of the key group then counts as changed."""
        if self.kg_counts[kg]:  # it was here before: its old slots hold nothing until loaded again
            old = np.flatnonzero(self.kg[: self.n] == kg)
            self.ver[old] = 0
            for c in self.columns.values():
                c.values[old] = c.init
                c.valid[old] = False
                c.present[old] = False
                c.all_valid = c.all_present = c.bound = None
        for name, table in base.items():
            if table.num_rows:
                self.load_checked(name, kg, table)
        for name, table in changes.items():
            if table.num_rows:  # upserts only (fits)
                self.load_checked(name, kg, table.drop_columns(["op"]) if "op" in table.schema.names else table)
        if self._unindexed is not None:
            self.finish_restore()
        n = self.n
        self.touch(np.flatnonzero(self._held(slice(0, n)) & (self.kg[:n] == kg)))

    def maybe_compact(self) -> None:
        """Drop the slots of key groups this subtask gave away (:meth:`release_key_group`) once
        they are :data:`_COMPACT_SHARE` of the store or more, and every capture is settled
        (:meth:`_settled`); the aggregate calls it before each batch."""
        if not self._released or not self._settled():
            return
        live = int(self.kg_counts[self.key_group_range.mask].sum())
        if self.n - live >= _COMPACT_SHARE * self.n:
            self.compact()

    def compact(self) -> None:
        """Keep only the slots of owned key groups that hold an entry of some state, in their
        order, in new arrays (never written in place: views a capture took stay as they
        were), and index them anew. Only when every capture is settled (:meth:`_settled`)."""
        if not self._settled():
            raise StateError(f"operator {self.operator_uid!r}: compact() after capture {self._last_captured}, which "
                             f"no confirmation covers yet (last confirmed: {self._last_confirmed}): its asynchronous "
                             "part may still read the store (a runtime bug)")
        n, cap = self.n, self.capacity
        kept = np.flatnonzero(self.key_group_range.mask[self.kg[:n]] & self._held(slice(0, n)))
        m = len(kept)
        new_slot = np.full(n, -1, np.int64)
        new_slot[kept] = np.arange(m)
        for name in ("keys", "kg", "ver"):
            old = getattr(self, name)
            new = np.zeros(cap, old.dtype)
            new[:m] = old[kept]
            setattr(self, name, new)
        for c in self.columns.values():
            values = np.full(cap, c.init, c.dtype)
            values[:m] = c.values[kept]
            valid = np.zeros(cap, bool)
            valid[:m] = c.valid[kept]
            present = np.zeros(cap, bool)
            present[:m] = c.present[kept]
            c.values, c.valid, c.present = values, valid, present
            c.all_valid = c.all_present = c.bound = None
        if self.var is not None:
            var = VarKeyStore(self.var.kind, cap)
            if m:
                var.append(self.var[kept].arrow_view())
            self.var = var
        for e, lists in self.dirty.items():
            moved = [new_slot[a] for a in lists]
            self.dirty[e] = [a[a >= 0] for a in moved]
        self.kg_counts = np.bincount(self.kg[:m], minlength=self.max_parallelism).astype(np.int64)
        self.n = m
        self._by_kg = None
        self._bulk = {}
        self._fill = None
        self.collisions = {}
        self.map = SlotMap()
        self._released = False
        self._unindexed = None
        if m:  # indexed as after a restore into a fresh store (a bulk not indexed yet is indexed with it)
            self._unindexed = 0
            self.finish_restore()

    def _settled(self) -> bool:
        """Every capture taken is covered by a confirmation: none is pending, and none that was
        aborted can still be written (a worker uploads its captures one after the other, so the
        upload of a confirmed checkpoint ends after those of every capture before it). The
        asynchronous part of a full capture reads the store's arrays (order_by_key_group)."""
        last = self._last_captured
        return last is None or (self._last_confirmed is not None and self._last_confirmed >= last)

    def _own(self, kg: int, what: str) -> None:
        if kg not in self.key_group_range:
            raise StateError(
                f"operator {self.operator_uid!r}: {what} key group {kg}, which this subtask does not own "
                f"(it owns {self.key_group_range}); the reconfiguration plan disagrees with the subtask (a bug)"
            )

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
            for name, by_kg in FrozenSlots(self, self._live(np.flatnonzero(dirty == want_dirty))).encode().items():
                for g, table in by_kg.items():
                    if want_dirty:
                        target.put_many(name, g, table.column("key").to_pylist(), table.column("value").to_pylist())
                    else:
                        target.restore(name, g, table)


_RELEASED = -1
"""``ver`` of the slots of a key group the subtask released (ver > confirmed epoch never holds
for it, so no capture lists it as changed)."""

_COMPACT_SHARE = 0.25
"""The share of a store's slots that key groups it gave away may hold before
:meth:`ColumnarKeyedState.maybe_compact` drops them."""

_BULK_ROOM = 2.5  # home positions per key of an index built by a restore (load 0.4: room for new keys before it grows at 1/2)
_BACKGROUND_FILL_MIN = 1 << 17  # keys a restore expects (from its first key group) from which a thread indexes them as they come
_FILL_RUN = 1 << 17  # keys handed to that thread at a time (the C fill keeps the GIL below 64 k)


def one_array(arr: Any) -> pa.Array:
    """A column as one array: a chunked array of one chunk is that chunk (``combine_chunks``
    copies even then: 40 MB of a restored key group of 5 M int64s took 0.09 s)."""
    if isinstance(arr, pa.ChunkedArray):
        return arr.chunk(0) if arr.num_chunks == 1 else arr.combine_chunks()
    return arr


def numpy_int64(arr: Any) -> np.ndarray:
    arr = one_array(arr)
    out = arr.to_numpy(zero_copy_only=False)
    return out if out.dtype == np.int64 else out.astype(np.int64)

