"""The storage of one declared state in the dict backend (:mod:`abs.state.dict_backend`):
per key group of the range a dict and a dirty set, or a :class:`~abs.columns.Column`, and the
state's handle."""
from __future__ import annotations

import pyarrow as pa

from abs.columns import OBJECTS, Column, typecode_of

from .descriptors import ReducingState, StateDescriptor
from .handles import (
    ColumnValueStateHandle,
    ListStateHandle,
    MapStateHandle,
    ReducingStateHandle,
    StateHandle,
    ValueStateHandle,
)
from .protocol import KeyedBackend

__all__ = ["StateSlot"]


class StateSlot:
    """Storage of one declared state: per absolute key group a dict and a dirty set, or a
    :class:`~abs.columns.Column` (``typecode`` set; its dirty set stays empty)."""

    __slots__ = ("descriptor", "data", "dirty", "deleted", "handle", "arrow_type", "immutable_values", "typecode")

    def __init__(self, descriptor: StateDescriptor, backend: KeyedBackend) -> None:
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
        self.handle: StateHandle
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

