"""What a manifest holds, and which of it a job can take (pure helpers shared by the
compatibility check and the restore planner)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from storage import Manifest

from .fingerprint import JobFingerprint

__all__ = ["OPERATOR_STATE_RULES", "Dropped", "Selection", "select", "sink_transactions_in_order", "source_offsets_of"]

OPERATOR_STATE_RULES = ("split", "union", "broadcast")
"""Redistribution rules of operator (non-keyed) state this planner knows."""


def source_offsets_of(value: Any) -> dict[str, Any]:
    """``source_offsets[uid]`` as ``{split id: offset}``; ``ValueError`` when malformed."""
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"expected an object of split id -> offset, got {type(value).__name__}")
    return dict(value)


def _checkpoint_of(txn: Any) -> int | None:
    if isinstance(txn, dict):
        for key in ("checkpoint_id", "checkpoint"):
            value = txn.get(key)
            if type(value) is int:
                return value
    return None


def sink_transactions_in_order(value: Any) -> list[Any]:
    """Every transaction handle of one sink, in checkpoint order; ``ValueError`` when malformed.

    ``value`` is what the runtime stores, ``{subtask: [handle, ...]}`` (each subtask's list
    oldest first), or a flat list. When every handle names its checkpoint (an int under
    ``checkpoint_id`` or ``checkpoint``) handles are sorted by it, ties by old subtask;
    otherwise they are concatenated in subtask order.
    """
    if isinstance(value, list):
        entries = [(0, txn) for txn in value]
    elif isinstance(value, dict):
        entries = []
        for key in sorted(value, key=lambda k: int(k) if isinstance(k, str) and k.isdigit() else -1):
            if not (isinstance(key, str) and key.isdigit()):
                raise ValueError(f"key {key!r} is not a subtask index")
            txns = value[key]
            if not isinstance(txns, list):
                raise ValueError(f"transactions of subtask {key} are a {type(txns).__name__}, not a list")
            entries.extend((int(key), txn) for txn in txns)
    else:
        raise ValueError(f"expected an object of subtask -> [transaction] or a list, got {type(value).__name__}")
    checkpoints = [_checkpoint_of(txn) for _, txn in entries]
    if entries and all(c is not None for c in checkpoints):
        order = sorted(range(len(entries)), key=lambda j: (checkpoints[j], entries[j][0], j))
        return [entries[j][1] for j in order]
    return [txn for _, txn in entries]


@dataclass(frozen=True)
class Dropped:
    """Snapshot content the job cannot take.

    ``reason``: ``unknown_operator`` (no operator with this uid), ``operator_kind`` (the
    operator cannot hold this kind of state) or ``undeclared_state`` (keyed state name not
    declared). ``holds`` describes the content.
    """

    reason: str
    uid: str
    state: str | None
    holds: str
    job_kind: str | None = None


@dataclass(frozen=True)
class Selection:
    """What to restore: keyed states per uid, uids whose operator state / source offsets /
    sink transactions are restored, and what is dropped."""

    keyed: dict[str, tuple[str, ...]]
    operator_state: tuple[str, ...]
    sources: tuple[str, ...]
    sinks: tuple[str, ...]
    dropped: tuple[Dropped, ...]


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _holdings(manifest: Manifest) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for uid, states in manifest.keyed.items():
        if states:
            out.setdefault(uid, []).append("keyed state " + ", ".join(repr(s) for s in sorted(states)))
    for uid, files in manifest.operator_state.items():
        if files:
            out.setdefault(uid, []).append(f"operator state ({_plural(len(files), 'file')})")
    for uid, offsets in manifest.source_offsets.items():
        if offsets:
            n = len(offsets) if isinstance(offsets, dict) else 0
            out.setdefault(uid, []).append(f"source offsets of {_plural(n, 'split')}")
    for uid, txns in manifest.sink_transactions.items():
        if txns:
            out.setdefault(uid, []).append("sink transactions")
    return out


def select(job: JobFingerprint | None, manifest: Manifest) -> Selection:
    """Match the manifest's content against the job's operators (``job=None`` or a job
    without operator list: take everything)."""
    if job is None or job.operators is None:
        return Selection(
            keyed={uid: tuple(sorted(states)) for uid, states in sorted(manifest.keyed.items()) if states},
            operator_state=tuple(sorted(u for u, f in manifest.operator_state.items() if f)),
            sources=tuple(sorted(u for u, o in manifest.source_offsets.items() if o)),
            sinks=tuple(sorted(u for u, t in manifest.sink_transactions.items() if t)),
            dropped=(),
        )
    ops = job.operators
    dropped: list[Dropped] = []
    for uid, holds in sorted(_holdings(manifest).items()):
        if uid not in ops:
            dropped.append(Dropped("unknown_operator", uid, None, "; ".join(holds)))
    keyed: dict[str, tuple[str, ...]] = {}
    for uid, states in sorted(manifest.keyed.items()):
        if uid not in ops:
            continue
        taken = []
        for state in sorted(states):
            if state in ops[uid].states:
                taken.append(state)
            else:
                dropped.append(Dropped("undeclared_state", uid, state, f"keyed state {state!r}", ops[uid].kind))
        if taken:
            keyed[uid] = tuple(taken)
    sources, sinks = [], []
    for uid, offsets in sorted(manifest.source_offsets.items()):
        if not offsets or uid not in ops:
            continue
        if ops[uid].kind == "source":
            sources.append(uid)
        else:
            dropped.append(Dropped("operator_kind", uid, None, "source offsets", ops[uid].kind))
    for uid, txns in sorted(manifest.sink_transactions.items()):
        if not txns or uid not in ops:
            continue
        if ops[uid].kind == "sink":
            sinks.append(uid)
        else:
            dropped.append(Dropped("operator_kind", uid, None, "sink transactions", ops[uid].kind))
    opstate = tuple(sorted(u for u, f in manifest.operator_state.items() if f and u in ops))
    return Selection(keyed=keyed, operator_state=opstate, sources=tuple(sources), sinks=tuple(sinks),
                     dropped=tuple(dropped))
