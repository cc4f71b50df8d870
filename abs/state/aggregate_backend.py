"""The aggregate's state backend: the columnar store (:mod:`abs.state.columnar`) while it
fits, the dict backend (:mod:`abs.state.dict_backend`) after, behind one
:class:`~abs.state.protocol.KeyedBackend`.

:class:`AggregateBackend` is what :class:`~abs.runtime.operators.KeyedOp` sees as
``self.backend`` of an aggregate. It starts columnar and migrates, once and for good, to the
dict backend when a batch's key column is neither an integer nor a string/binary type, has
nulls, holds uint64 keys beyond int64 or keys of another kind than the store's (int, string,
binary: a store holds one), when a value column is neither integer nor floating, or when a
restored or handed-over table does not fit the same way (a live reconfiguration's key groups
move in the columnar form otherwise). The migration keeps every value, and every key changed since
the last confirmed checkpoint stays dirty (later deltas may carry a few more keys than
strictly needed, never fewer).
"""
from __future__ import annotations

from typing import Any, Iterator, Mapping

import pyarrow as pa

from abs.keygroups import KeyGroupRange

from . import handover
from .columnar import ColumnarKeyedState, columnar_descriptors_ok
from .descriptors import StateDescriptor
from .dict_backend import KeyedStateBackend
from .protocol import KeyedBackend

__all__ = ["AggregateBackend"]


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
    def impl(self) -> KeyedBackend:
        """The backend in use: the columnar store, or the dict backend once migrated."""
        return self.columnar if self.columnar is not None else self.dict_backend

    def migrate_to_dict(self) -> None:
        if self.columnar is not None:
            col, self.columnar = self.columnar, None
            col.move_to(self.dict_backend)

    # the KeyedBackend protocol
    @property
    def descriptors(self) -> tuple[StateDescriptor, ...]:
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

    def capture(self, checkpoint_id: int, *, lazy: bool = False) -> dict[str, dict[int, Any]]:
        return self.impl.capture(checkpoint_id, lazy=lazy)

    def capture_full(self, checkpoint_id: int) -> dict:
        return self.impl.capture_full(checkpoint_id)

    def confirm(self, checkpoint_id: int) -> None:
        self.impl.confirm(checkpoint_id)

    def abort(self, checkpoint_id: int) -> None:
        self.impl.abort(checkpoint_id)

    def restore(self, state_name: str, kg: int, table: pa.Table, *, verify: bool = False) -> None:
        if self.columnar is not None:
            if self.columnar.check_restore_table(state_name, kg, table):
                self.columnar.load_checked(state_name, kg, table, verify=verify)
                return
            self.migrate_to_dict()
        self.dict_backend.restore(state_name, kg, table, verify=verify)

    def restore_slices(self, state_name: str, table: pa.Table, parts: Any) -> None:
        """:meth:`restore` of ``table.slice(offset, rows)`` into key group ``kg`` for each
        ``(kg, offset, rows)`` of ``parts`` (one shared range of a snapshot): in bulk by the
        columnar store when it takes them all so
        (:meth:`ColumnarKeyedState.restore_slices`), else key group by key group."""
        if self.columnar is not None and self.columnar.restore_slices(state_name, table, parts):
            return
        if self.columnar is None:
            self.dict_backend.restore_slices(state_name, table, parts)
            return
        for kg, offset, rows in parts:
            self.restore(state_name, kg, table.slice(offset, rows))

    def expect_restore(self, keys: int) -> None:
        """A restore about to begin brings at most ``keys`` keys (see
        :meth:`ColumnarKeyedState.expect_restore`)."""
        if self.columnar is not None:
            self.columnar.expect_restore(keys)

    def finish_restore(self) -> None:
        """After the last key group of a restore: the columnar store indexes the keys it
        restored in bulk (:meth:`ColumnarKeyedState.finish_restore`)."""
        if self.columnar is not None:
            self.columnar.finish_restore()

    # live reconfiguration (abs.state.handover): key groups move in the columnar form while
    # the store is columnar; the dict backend owns the same key groups (one shared set), empty
    def export_key_group(self, kg: int, *, full: bool) -> dict[str, pa.Table]:
        if self.columnar is not None:
            return self.columnar.export_key_group(kg, full=full)
        return handover.export_key_group(self.dict_backend, kg, full=full)

    def release_key_group(self, kg: int) -> None:
        if self.columnar is not None:
            self.columnar.release_key_group(kg)
        handover.release_key_group(self.dict_backend, kg)

    def adopt_key_group(self, kg: int, base: Mapping[str, pa.Table], changes: Mapping[str, pa.Table]) -> None:
        """Load key group ``kg`` into the columnar store when every table fits it, else move
        to the dict backend first (as a restore does)."""
        if self.columnar is not None:
            handover.adopt_key_group(self.dict_backend, kg, {}, {})  # owned from now on, empty there
            if self.columnar.fits(kg, [*base.items(), *changes.items()]):
                self.columnar.adopt_key_group(kg, base, changes)
                return
            handover.release_key_group(self.dict_backend, kg)
            self.migrate_to_dict()
        handover.adopt_key_group(self.dict_backend, kg, base, changes)

    def items(self, name: str, kg: int | None = None) -> Iterator[tuple[Any, Any]]:
        return self.impl.items(name, kg)

