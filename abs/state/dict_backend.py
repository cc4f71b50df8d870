"""The dict backend: in-memory keyed state of one operator subtask, per key group, with
per-key-group dirty tracking (see :mod:`abs.state` for the hot path and the snapshot rules).

Per declared state, one ``dict`` (key -> value) per key group of the backend's
:class:`~abs.keygroups.KeyGroupRange` (value states of a fixed-width numeric type or untyped:
a :class:`~abs.columns.Column`), in a list indexed by the *absolute* key group (slots of key
groups outside the range are ``None``): see :class:`~abs.state.slots.StateSlot`.
"""
from __future__ import annotations

import itertools
from typing import Any, Iterable, Iterator, Sequence

import pyarrow as pa

from abs.columns import OBJECTS, Column
from abs.errors import ConfigError, StateError
from abs.keygroups import KeyGroupRange, KeyGroupSet, check_max_parallelism, key_group
from abscore.native import NATIVE

from .capture import ColumnDelta, PendingDelta, PickledDelta
from .descriptors import KINDS, StateDescriptor
from .encoding import (
    ENCODING_ARROW,
    META_KEY_ENCODING,
    META_STATE_KIND,
    META_VALUE_ENCODING,
    MISSING,
    arrow_to_list,
    check_restore_table,
    decode_column,
    encode,
)
from .restored import RestoredColumn
from .slots import StateSlot
from .varkeys import var_key_kind

__all__ = ["KeyedStateBackend"]


def _hashable(key: Any) -> bool:
    try:
        hash(key)
    except TypeError:
        return False
    return True


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
        if not isinstance(key_group_range, (KeyGroupRange, KeyGroupSet)) or key_group_range.end >= max_parallelism:
            raise ConfigError(
                f"operator {operator_uid!r}: key group range {key_group_range} is not a "
                f"KeyGroupRange within [0, {max_parallelism - 1}]; compute it with "
                "key_group_range(max_parallelism, parallelism, subtask)"
            )
        self.current_key: Any = None
        self.current_kg: Any = None
        self.operator_uid = operator_uid
        self.max_parallelism = max_parallelism
        # the key groups owned now: a range at start, any set after live reconfiguration
        # moved key groups (abs.state.handover)
        self.key_group_range = KeyGroupSet.of(max_parallelism, key_group_range)
        self._slots: dict[str, StateSlot] = {}
        for d in descriptors:
            if not isinstance(d, tuple(KINDS.values())):
                raise ConfigError(
                    f"operator {operator_uid!r}: {d!r} is not a state descriptor; declare "
                    "ValueState, ListState, MapState or ReducingState"
                )
            if d.name in self._slots:
                raise ConfigError(
                    f"operator {operator_uid!r}: state {d.name!r} is declared twice; give "
                    "each state its own name"
                )
            self._slots[d.name] = StateSlot(d, self)
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

    def _slot(self, name: str) -> StateSlot:
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

    def fold_many(self, name: str, kg: int, keys: list, partials: Any, fn: str) -> Any:
        """The aggregate's merge of per-key partial results (a numpy array; ``fn``: ``sum``,
        ``count``, ``min`` or ``max``) into distinct ``keys`` of key group ``kg`` in one numpy
        operation: the merged values (numpy), or ``None`` with nothing changed when the state
        must be merged key by key (see :meth:`abs.columns.Column.fold`)."""
        slot = self._slot(name)
        self._check_kg(kg, "fold_many:")
        if slot.typecode is None:
            return None
        return slot.data[kg].fold(keys, partials, fn, self.epoch)

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
            if d.pop(k, MISSING) is not MISSING:
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
        rng = self.key_group_range
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
                    out[name][kg] = PickledDelta(kind, keys, list(map(get, keys, itertools.repeat(MISSING))))
            else:
                changed = sorted(self._unconfirmed_keys(name).items())
                out[name] = {kg: encode(self.operator_uid, slot, kg, keys, data[kg], with_op=True) for kg, keys in changed}
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
                kg: encode(self.operator_uid, slot, kg, data[kg], data[kg], with_op=True)
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

    def _capture_columns(self, slot: StateSlot, since: int, *, lazy: bool, full: bool = False) -> dict[int, Any]:
        out: dict[int, Any] = {}
        for kg in self.key_group_range:
            captured = slot.data[kg].capture(since, full=full)
            if captured is not None:
                delta = ColumnDelta(captured, slot.arrow_type, slot.descriptor.kind)
                out[kg] = delta if lazy else delta.to_table()
        return out

    def _column_set(self, slot: StateSlot, col: Column, key: Any, value: Any, epoch: int) -> None:
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

    # ------------------------------------------------------------------ restore
    def finish_restore(self) -> None:
        """Nothing to do: each restored key group is complete as it comes (its index is made
        on its first use, :mod:`abs.state.restored`)."""

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
        keys = decode_column(table.column("key"), meta.get(META_KEY_ENCODING), where, "key")
        values = decode_column(table.column("value"), meta.get(META_VALUE_ENCODING), where, "value")
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
        elif d:
            d.update(zip(keys, values))
        else:  # the usual restore, into an empty key group: a dict built at once, not grown
            slot.data[kg] = dict(zip(keys, values))

    def restore_slices(self, state_name: str, table: pa.Table, parts: Sequence[tuple[int, int, int]]) -> None:
        """:meth:`restore` of ``table.slice(offset, rows)`` into key group ``kg`` for each
        ``(kg, offset, rows)`` of ``parts`` (the key groups of one shared range of a snapshot,
        :meth:`SnapshotStore.read_range`), with what does not depend on the key group done
        once: the checks of the table, the cast of its values, their numpy form. A key group
        that is not an empty typed column, or a table not of the shape :meth:`_load_column`
        loads in bulk, goes through :meth:`restore` (which raises what it raises)."""
        slot = self._slot(state_name)
        loaded = self._load_slices(slot, table, parts)
        for kg, offset, rows in parts:
            if kg not in loaded:
                self.restore(state_name, kg, table.slice(offset, rows))

    def _load_slices(self, slot: StateSlot, table: pa.Table, parts: Sequence[tuple[int, int, int]]) -> set[int]:
        """The key groups of ``parts`` :meth:`restore_slices` kept as restored columns (see
        :meth:`_load_column`); none when the table is not of that shape or does not pass
        :func:`check_restore_table` (the caller's :meth:`restore` then names the problem)."""
        meta = table.schema.metadata or {}
        if slot.typecode is None or len(parts) < 2:
            return set()
        kind = meta.get(META_STATE_KIND)
        names = table.schema.names
        if (kind is not None and kind.decode() != slot.descriptor.kind) or "key" not in names or "value" not in names \
                or "op" in names:
            return set()
        arrays = self._bulk_arrays(slot, table, meta)
        if arrays is None:
            return set()
        keys, array, nulls, text = arrays
        loaded: set[int] = set()
        owned = self.key_group_range
        for kg, offset, rows in parts:
            if type(kg) is not int or kg not in owned:
                continue  # restore() refuses it
            col = slot.data[kg]
            if type(col) is not Column or len(col) or col.deleted:
                continue  # restore() loads it into what the key group holds
            end = offset + rows
            mask = None if nulls is None else nulls[offset:end]
            RestoredColumn.keep(col, keys.slice(offset, rows) if text else keys[offset:end], array[offset:end],
                                mask if mask is not None and mask.any() else None)
            loaded.add(kg)
        return loaded

    @staticmethod
    def _bulk_arrays(slot: StateSlot, table: pa.Table, meta: dict) -> tuple | None:
        """``(keys, values, nulls, text)`` of an Arrow-encoded table with integer, string or
        binary keys, as a bulk load takes them (keys: int64 numpy, or the Arrow column of text
        keys; values: numpy of the slot's type, nulls as 0; nulls: a mask or None); None when
        the table or the slot is not of that shape (the key by key path takes it, and names a
        value that does not fit)."""
        if slot.arrow_type is None:
            return None  # an untyped column: Arrow values go in key by key, as Python objects
        if meta.get(META_KEY_ENCODING) != ENCODING_ARROW or meta.get(META_VALUE_ENCODING) != ENCODING_ARROW:
            return None
        key_col, value_col = table.column("key"), table.column("value")
        kt = key_col.type
        text = var_key_kind(kt) is not None
        if not (pa.types.is_integer(kt) or text) or key_col.null_count:
            return None
        try:
            keys = key_col if text else key_col.cast(pa.int64()).to_numpy()
            values = value_col.cast(slot.arrow_type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
            return None
        nulls = values.is_null().to_numpy() if values.null_count else None
        return keys, (values.fill_null(0) if values.null_count else values).to_numpy(), nulls, text

    def _load_column(self, slot: StateSlot, kg: int, table: pa.Table, meta: dict) -> bool:
        """Bulk-load an Arrow-encoded table with integer, string or binary keys into an empty
        column, kept as arrays until the key group is first used (:mod:`abs.state.restored`);
        False when the table or the column is not of that shape (the caller loads it key by
        key). String keys went key by key before: 1M of them with int64 values took 0.55 s of
        CPU; built at once, 0.2 s."""
        arrays = self._bulk_arrays(slot, table, meta)
        if arrays is None:
            return False
        keys, values, nulls, text = arrays
        col = slot.data[kg]
        if type(col) is Column and not len(col) and not col.deleted:
            # the usual restore, into an empty key group: probed or built when it is first
            # used (abs.state.restored)
            RestoredColumn.keep(col, keys, values, nulls)
            return True
        return col.load(arrow_to_list(keys) if text else keys, values, nulls)


if NATIVE is not None:
    # the classes whose __slots__ the C value()/update() of ColumnValueStateHandle read directly
    # (current_key, current_kg, epoch; a column's index, values, stamps, nulls; a restored
    # key group's image, its index once probed: abs.state.restored)
    NATIVE.configure_value_handles(KeyedStateBackend, Column, RestoredColumn)
