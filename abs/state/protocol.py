"""The keyed-backend protocol: what every keyed state backend promises the runtime.

Two backends implement it: :class:`~abs.state.dict_backend.KeyedStateBackend` (any keys, any
state kind, handles for per-record user code) and
:class:`~abs.state.columnar.ColumnarKeyedState` (int64, string or binary keys, numeric value
states, folded a batch at a time by the aggregate), and :class:`~abs.state.aggregate_backend.AggregateBackend`,
which is one and then the other. :class:`~abs.runtime.operators.KeyedOp` restores, snapshots,
confirms and aborts through this protocol alone.

What they promise (``tests/test_state_contract.py`` checks it against each):

* **key groups**: a backend holds the key groups of its ``key_group_range`` only; every table
  it captures or restores is the state of one key group, and every key in it hashes there;
* **capture(n)** (the synchronous part of snapshot ``n``): state name -> key group -> delta,
  every declared state present, only key groups with a key changed since the last
  *confirmed* checkpoint, each delta holding every such key (perhaps a few more, never fewer);
  a delta is a ``pyarrow.Table`` or, with ``lazy=True``, a :class:`Delta` encoded later;
  ids must increase;
* **capture_full(n)**: every non-empty key group's full contents as upserts; counts as a
  capture;
* **confirm(n)**: checkpoint ``n`` completed, forget what captures ``<= n`` took (repeated or
  out-of-order confirmations are harmless); **abort(n)**: forget nothing;
* **restore(state, kg, table)**: upsert a resolved table (the chain of ``kg`` folded into one
  table, no deletes) into ``state``; restored keys are not changed keys (the next delta does not
  carry them); ``verify=True`` also checks that each key hashes to ``kg``; a table of another
  state kind, or one with unresolved deletes, is refused with a :class:`~abs.errors.StateError`;
* **finish_restore()**: after the last restore of a batch of them (the runtime calls it once
  a subtask's key groups are all loaded), finish what the restores deferred;
* **items(state, kg=None)**: the live ``(key, value)`` pairs, for inspection and tests.

The tables have one encoding whatever the backend (:mod:`abs.state.encoding`), so a snapshot
written by one restores into the other.

The protocol is static only (a :class:`typing.Protocol`, checked by type checkers): the
per-record path never goes through it. Per-record and per-batch writes are each backend's
own (handles on the dict backend; ``slots_for``/``touch`` on the columnar store).
"""
from __future__ import annotations

from typing import Any, Iterator, Mapping, Protocol, Union, runtime_checkable

import pyarrow as pa

from abs.keygroups import KeyGroupRange

from .descriptors import StateDescriptor

__all__ = ["CapturedDeltas", "Delta", "KeyedBackend"]


@runtime_checkable
class Delta(Protocol):
    """A key group's delta captured by reference or by copy, encoded by :meth:`to_table` in
    the asynchronous part of a snapshot (in another thread, or another process when it is
    picklable)."""

    @property
    def complete(self) -> bool:
        """The table holds every live key of its key group (storage may write it as a new
        base without reading the chain back). Read it after :meth:`to_table`, which may set it."""
        ...

    def to_table(self) -> pa.Table:
        """The delta table (``key``, ``value``, ``op``; see :mod:`abs.state.encoding`)."""
        ...


CapturedDeltas = Mapping[str, Mapping[int, Union[pa.Table, Delta]]]
"""What a capture returns: state name -> key group -> delta table or :class:`Delta`."""


@runtime_checkable
class KeyedBackend(Protocol):
    """The keyed state of one operator subtask, as the runtime snapshots and restores it
    (see the module docstring for the promises)."""

    @property
    def operator_uid(self) -> str: ...

    @property
    def max_parallelism(self) -> int: ...

    @property
    def key_group_range(self) -> KeyGroupRange: ...

    @property
    def descriptors(self) -> tuple[StateDescriptor, ...]:
        """The declared states, in declaration order."""
        ...

    @property
    def last_confirmed(self) -> int | None:
        """Highest confirmed checkpoint id (None before the first confirm)."""
        ...

    @property
    def pending_captures(self) -> tuple[int, ...]:
        """Ids captured and neither confirmed nor aborted, ascending."""
        ...

    def capture(self, checkpoint_id: int, *, lazy: bool = False) -> dict[str, dict[int, Any]]:
        """Synchronous part of snapshot ``checkpoint_id``: state -> key group -> delta."""
        ...

    def capture_full(self, checkpoint_id: int) -> dict[str, dict[int, pa.Table]]:
        """Every non-empty key group's full contents as upserts (counts as a capture)."""
        ...

    def confirm(self, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` completed: forget what captures up to it took."""
        ...

    def abort(self, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` will never complete: nothing is forgotten."""
        ...

    def restore(self, state_name: str, kg: int, table: pa.Table, *, verify: bool = False) -> None:
        """Upsert a resolved table of key group ``kg`` into ``state_name`` (keys stay clean)."""
        ...

    def finish_restore(self) -> None:
        """After the last :meth:`restore` of a restore: finish what the restore deferred (the
        columnar store's key index). Anything that needs it finishes it first anyway."""
        ...

    def items(self, name: str, kg: int | None = None) -> Iterator[tuple[Any, Any]]:
        """``(key, value)`` pairs of state ``name`` in key group ``kg`` (all when None)."""
        ...
