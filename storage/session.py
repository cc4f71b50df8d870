"""``CheckpointSession``: the one owner of a job's key-group chains across checkpoints.

A chain (a base, then deltas or a values image, oldest first) lives on from checkpoint to
checkpoint: each checkpoint writes a key group's capture over the chain the last *complete*
checkpoint left, and the chain it writes becomes the one to build on only once its
checkpoint completes. A session keeps that bookkeeping in one place:

* the chains to build on, per (operator, state, key group), and the chains each checkpoint in
  flight wrote, until it completes (:meth:`confirm`) or is aborted (:meth:`abort`);
* the writes of one checkpoint (:meth:`write`): what to write for each key group is decided
  by :func:`storage.chain_decision.decide_chain` inside
  :meth:`SnapshotStore.write_key_groups`; the session adds what it remembers from earlier
  writes, the base each key group's keys were last written into, so that a full image over
  unchanged keys becomes a values image (:attr:`KeyGroupWrite.over_base`);
* the acks of one checkpoint, turned into its manifest (:meth:`manifest`).

A job's processes each hold a session for their part: a worker's operators for the key
groups they own, a snapshot writer for what it wrote, the driver for the manifests. Nothing
here is a global; no I/O but through the store passed in.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import pyarrow as pa

from .errors import InvalidChainError
from .manifest import FileRef, Lineage, Manifest
from .store_write import KeyGroupWrite

__all__ = ["CheckpointSession", "KeyGroupCapture", "merge_acks", "with_written"]

Chains = dict[str, dict[int, list[FileRef]]]  # state -> key group -> chain (one operator's)
Slot = tuple[str, str, int]  # (operator, state, key group)


@dataclass(frozen=True)
class KeyGroupCapture:
    """One key group's capture at one checkpoint, for :meth:`CheckpointSession.write`.

    ``delta``, ``complete``, ``image``: as for :class:`storage.store_write.KeyGroupWrite` (``delta``
    may be a zero-argument callable). ``image_keys``: for a capture that can be a full image,
    a zero-argument callable returning the object that holds the image's keys (or ``None``):
    the same object (by identity) at two checkpoints means the same keys, which lets the
    second image be written as a values image over the base the first was written into. It
    is called before the write and again after it (the write may set the keys' order).
    ``values_image``, ``rows``, ``base``: as for :class:`~storage.store_write.KeyGroupWrite`."""

    operator: str
    state: str
    key_group: int
    prev_chain: Sequence[FileRef]
    delta: "pa.Table | Callable[[], pa.Table]"
    complete: bool = False
    image: Callable[[], "pa.Table | None"] | None = None
    image_keys: Callable[[], Any] | None = None
    values_image: Callable[[], "pa.Table | None"] | None = None
    rows: int | None = None
    base: Callable[[], "pa.Table | None"] | None = None

    @property
    def slot(self) -> Slot:
        return (self.operator, self.state, self.key_group)


def with_written(prev: Mapping[str, Mapping[int, Sequence[FileRef]]],
                 written: Iterable[tuple[str, int, Sequence[FileRef]]]) -> Chains:
    """One operator's chains after a checkpoint: ``prev`` (state -> key group -> chain) with
    the chains ``written`` as ``(state, key group, chain)``; an empty chain drops its key
    group (it holds no state any more)."""
    chains: Chains = {state: {kg: list(chain) for kg, chain in by_kg.items()} for state, by_kg in prev.items()}
    for state, kg, chain in written:
        target = chains.setdefault(state, {})
        if chain:
            target[kg] = list(chain)
        else:
            target.pop(kg, None)
    return chains


def merge_acks(acks: Iterable[Mapping[str, Any]]) -> tuple[dict, dict, dict]:
    """``(keyed, source_offsets, sink_transactions)`` of a manifest from the acks of one
    checkpoint (mappings, or objects with these attributes; each with ``"keyed"``: operator -> state -> key group -> chain,
    ``"source_offsets"``: operator -> split -> offset, ``"sink_transactions"``: operator ->
    subtask -> transactions); later acks add to and override earlier ones per split and
    subtask. A key group named by two acks is refused (:class:`InvalidChainError`): each key
    group has one owner in a checkpoint, also while live reconfiguration moves it."""
    keyed: dict = {}
    offsets: dict = {}
    sinks: dict = {}
    for ack in acks:
        for uid, states in _part(ack, "keyed").items():
            for state, by_kg in states.items():
                merged = keyed.setdefault(uid, {}).setdefault(state, {})
                twice = sorted(set(merged) & set(by_kg))
                if twice:
                    raise InvalidChainError(
                        f"operator {uid!r}, state {state!r}: key group(s) {twice} are in the snapshots of two "
                        "subtasks of one checkpoint; the checkpoint is not committed (a bug of the runtime: "
                        "report it)"
                    )
                merged.update(by_kg)
        for uid, offs in _part(ack, "source_offsets").items():
            offsets.setdefault(uid, {}).update(offs)
        for uid, by_sub in _part(ack, "sink_transactions").items():
            sinks.setdefault(uid, {}).update(by_sub)
    return keyed, offsets, sinks


def _has(ack: Any, name: str) -> bool:
    return name in ack if isinstance(ack, Mapping) else hasattr(ack, name)


def _part(ack: Any, name: str) -> Mapping:
    """A part of an ack given as a mapping or as an object with that attribute (the
    runtime's typed acks)."""
    return ack[name] if isinstance(ack, Mapping) else getattr(ack, name)


class CheckpointSession:
    """A job's key-group chains across checkpoints (see the module docstring). Not
    thread-safe: one owner calls it (an operator's task, a writer, the driver)."""

    def __init__(self) -> None:
        self._confirmed: dict[str, Chains] = {}  # operator -> the chains to build on
        self._pending: dict[int, dict[str, Chains]] = {}  # checkpoint -> operator -> chains it wrote
        self._bases: dict[Slot, tuple[FileRef, Any]] = {}  # see write()
        # operator -> [(key group, last checkpoint captured before it moved)]: see forget()
        self._moved: dict[str, list[tuple[int, int]]] = {}

    # ------------------------------------------------------------------ chains
    def declare(self, operator: str, states: Iterable[str]) -> None:
        """Make the states of ``operator`` known, each without key groups yet."""
        for state in states:
            self._confirmed.setdefault(operator, {}).setdefault(state, {})

    def restored(self, operator: str, state: str, key_group: int, chain: Sequence[FileRef]) -> None:
        """A restore read ``chain``: the next checkpoint builds on it."""
        self._confirmed.setdefault(operator, {}).setdefault(state, {})[key_group] = list(chain)

    def confirmed(self, operator: str) -> Chains:
        """The chains of ``operator`` that the next checkpoint builds on (state -> key group ->
        chain; the session's own, not a copy)."""
        return self._confirmed.setdefault(operator, {})

    def prev_chains(self, operator: str, *, full: bool = False) -> Chains:
        """What a checkpoint of ``operator`` builds on: its confirmed chains, or, for a full
        snapshot (every key group written as a new base), no chain in any of its states."""
        return {state: ({} if full else dict(by_kg)) for state, by_kg in self.confirmed(operator).items()}

    def written(self, checkpoint_id: int, operator: str, chains: Mapping[str, Mapping[int, Sequence[FileRef]]]) -> None:
        """Checkpoint ``checkpoint_id`` wrote ``operator``'s chains (state -> key group -> chain,
        all of them); they count once it completes."""
        self._pending.setdefault(checkpoint_id, {})[operator] = {s: dict(c) for s, c in chains.items()}

    def confirm(self, checkpoint_id: int, operator: str) -> bool:
        """Checkpoint ``checkpoint_id`` completed: ``operator``'s chains it wrote become the ones
        to build on, and what older checkpoints wrote is forgotten. ``False`` when that
        checkpoint wrote none for it (e.g. it was aborted here)."""
        written = self._pending.get(checkpoint_id, {}).pop(operator, None)
        if written is not None:
            moved = self._moved.get(operator)
            if moved:
                for kg, captured in moved:
                    if checkpoint_id <= captured:  # written before the key group moved
                        for by_kg in written.values():
                            by_kg.pop(kg, None)
                moved[:] = [(kg, captured) for kg, captured in moved if captured >= checkpoint_id]
            self._confirmed[operator] = written
        for cid in [c for c in self._pending if c <= checkpoint_id]:
            self._pending[cid].pop(operator, None)
            if not self._pending[cid]:
                del self._pending[cid]
        return written is not None

    def forget(self, operator: str, key_group: int, captured: int) -> None:
        """Key group ``key_group`` of ``operator`` moved out of this subtask, or into it
        (live reconfiguration) after checkpoint ``captured`` was the last one captured here:
        no chain of it is built on from now on. Checkpoints up to ``captured`` wrote what
        they captured (the key group at its owner then) and may still complete: their chains
        of it are dropped when they are confirmed, so an old owner never names the key group
        again and a new owner writes it whole as a base of its own."""
        for by_kg in self._confirmed.get(operator, {}).values():
            by_kg.pop(key_group, None)
        self._moved.setdefault(operator, []).append((key_group, captured))
        for slot in [s for s in self._bases if s[0] == operator and s[2] == key_group]:
            del self._bases[slot]

    def abort(self, checkpoint_id: int, operator: str) -> None:
        """Checkpoint ``checkpoint_id`` was aborted: forget ``operator``'s chains it wrote."""
        pending = self._pending.get(checkpoint_id)
        if pending is not None:
            pending.pop(operator, None)
            if not pending:
                del self._pending[checkpoint_id]

    def pending_ids(self) -> list[int]:
        """The checkpoints whose written chains wait for their completion or abort."""
        return sorted(self._pending)

    # ------------------------------------------------------------------ writing
    def write(self, store: Any, checkpoint_id: int, captures: Sequence[KeyGroupCapture]) -> list[list[FileRef]]:
        """Write one checkpoint's ``captures`` with :meth:`SnapshotStore.write_key_groups` and
        return their new chains in capture order; the first failure raises.

        Remembered from one write to the next: per key group whose capture has
        ``image_keys``, the base last written from a full image and the object holding that
        image's keys. A full image whose keys are still that very object (no insert or delete
        since), over a chain the base still heads, is written as a values image over it: a
        state whose keys stay while its values change then writes its keys once.
        """
        writes = [KeyGroupWrite(c.operator, c.state, c.key_group, c.prev_chain, c.delta, c.complete, c.image,
                                self._over_base(c), c.values_image, c.rows, c.base) for c in captures]
        chains = store.write_key_groups(checkpoint_id, writes)  # capture order; the first failure raises
        for capture, chain in zip(captures, chains):
            if capture.image_keys is not None:
                self._remember_base(checkpoint_id, capture.slot, chain, capture.image_keys())
        return chains

    def over_base(self, capture: KeyGroupCapture) -> FileRef | None:
        """The base :meth:`write` would write ``capture``, a full image, over as a values image
        (its keys are still those the base was written with, and the base heads its chain),
        or ``None``."""
        return self._over_base(capture)

    def _over_base(self, capture: KeyGroupCapture) -> FileRef | None:
        known = self._bases.get(capture.slot) if capture.image_keys is not None else None
        if known is None or not capture.prev_chain or capture.prev_chain[0] != known[0]:
            return None
        return known[0] if capture.image_keys() is known[1] else None  # type: ignore[misc]

    def _remember_base(self, checkpoint_id: int, slot: Slot, chain: Sequence[FileRef], keys: Any) -> None:
        head = chain[0] if chain else None
        if head is not None and len(chain) == 1 and head.kind == "base" and head.checkpoint_id == checkpoint_id \
                and keys is not None and head.rows == len(keys):
            self._bases[slot] = (head, keys)  # written from this full image: its keys are these
        elif head is None or slot not in self._bases or self._bases[slot][0] != head:
            self._bases.pop(slot, None)

    # ------------------------------------------------------------------ committing
    @staticmethod
    def manifest(checkpoint_id: int, acks: Iterable[Mapping[str, Any]], *, job_name: str,
                 max_parallelism: int, stats: Mapping[str, Any] | None = None,
                 lineage: Lineage | None = None, assignment: Sequence[int] | None = None) -> Manifest:
        """The manifest of checkpoint ``checkpoint_id`` from the acks of its tasks (see
        :func:`merge_acks`), to be committed with :meth:`SnapshotStore.commit`; ``assignment``:
        the owner of each key group when live reconfiguration had moved some."""
        acks = list(acks)
        keyed, offsets, sinks = merge_acks(acks)
        # an iteration head's logged feedback records (channel state), in the order of the acks
        logs = [ref for ack in acks for ref in (_part(ack, "channel_logs") if _has(ack, "channel_logs") else ())]
        return Manifest(checkpoint_id=checkpoint_id, job_name=job_name, max_parallelism=max_parallelism,  # type: ignore[arg-type]
                        keyed=keyed, source_offsets=offsets, sink_transactions=sinks, stats=dict(stats or {}),
                        channel_logs=logs,
                        lineage=lineage, assignment=None if assignment is None else tuple(assignment))
