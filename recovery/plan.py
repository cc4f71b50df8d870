"""Restore plans: what every subtask of a (possibly rescaled) job restores from a checkpoint.

:func:`plan_restore` is pure: a manifest, the job fingerprint and the new parallelism in, a
:class:`RestorePlan` out. It never reads a state file; executing the plan (reading chains,
re-committing sink transactions) is the runtime's job.

Redistribution rules:

- **Keyed state**: subtask ``i`` of ``P`` owns key groups ``key_group_range(M, P, i)`` and
  gets exactly their chains (base + deltas, as in the manifest), nothing else.
- **Source splits**: the splits the job knows now, united with the splits in the snapshot,
  sorted by id, assigned round robin (split ``j`` to subtask ``j mod P``). A split the
  snapshot has read keeps its offset; a split it never read gets ``None`` ("start at the
  initial offset") and is listed in ``SubtaskPlan.initial_splits``.
- **Sink transactions** (rule "union"): every subtask gets all of the snapshot's transaction
  handles of the sink, in checkpoint order; each writer re-commits those it owns
  (idempotently) and discards the rest.
- **Operator state** by the manifest's ``operator_state_rules``: ``union`` and
  ``broadcast`` give every subtask all files (ordered by old subtask); ``split`` deals the
  files round robin (the ``k``-th file by old subtask to subtask ``k mod P``).
- **Channel logs** (in-flight records of iteration heads): the log of task ``task<t>#<s>``
  goes to subtask ``s mod P`` (others round robin by position); each log is replayed exactly
  once, through the normal partitioning of the head's inputs.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from abscore.keygroups import KeyGroupRange, check_parallelism, key_group_range, routing_table
from abscore.units import human_bytes
from storage import FileRef, Manifest

from ._content import select, sink_transactions_in_order, source_offsets_of
from .check import check_manifest
from .fingerprint import JobFingerprint
from .errors import IncompatibleSnapshotError

__all__ = ["RestorePlan", "SubtaskPlan", "plan_restore"]

_TASK_SUBTASK = re.compile(r"#(\d+)$")


@dataclass(frozen=True)
class SubtaskPlan:
    """What subtask ``index`` restores. Plain data (dicts and lists of :class:`FileRef`;
    treat them as read-only): picklable, printable, comparable.

    - ``keyed[uid][state][key_group]``: the chain of each of its key groups that holds state.
    - ``source_splits[uid][split]``: start offset; ``None`` for splits in ``initial_splits[uid]``.
    - ``sink_transactions[uid]``: handles to re-commit (all of the sink's, see module doc).
    - ``operator_state[uid]``: operator-state files to read.
    - ``channel_logs``: logged in-flight records to replay first.
    """

    index: int
    key_groups: KeyGroupRange
    keyed: dict[str, dict[str, dict[int, list[FileRef]]]] = field(default_factory=dict)
    source_splits: dict[str, dict[str, Any]] = field(default_factory=dict)
    initial_splits: dict[str, tuple[str, ...]] = field(default_factory=dict)
    sink_transactions: dict[str, list[Any]] = field(default_factory=dict)
    operator_state: dict[str, list[FileRef]] = field(default_factory=dict)
    channel_logs: list[FileRef] = field(default_factory=list)

    def files(self) -> list[FileRef]:
        """Every distinct file (or range of a packed file) this subtask reads, keyed chains first."""
        seen: dict[str, FileRef] = {}
        for states in self.keyed.values():
            for chains in states.values():
                for chain in chains.values():
                    for ref in chain:
                        seen.setdefault(ref.id, ref)
        for refs in self.operator_state.values():
            for ref in refs:
                seen.setdefault(ref.id, ref)
        for ref in self.channel_logs:
            seen.setdefault(ref.id, ref)
        return list(seen.values())

    @property
    def file_count(self) -> int:
        """Distinct files this subtask reads: a packed file counts once however many of its
        ranges (:meth:`files`, one per key group it holds) the subtask reads."""
        return len({ref.path for ref in self.files()})

    @property
    def read_bytes(self) -> int:
        """Bytes this subtask reads (each distinct file or range once; a range shared by key
        groups of several subtasks is read whole by each)."""
        return sum({ref.range_id: ref.read_size for ref in self.files()}.values())

    @property
    def keyed_bytes(self) -> int:
        return sum(ref.bytes for states in self.keyed.values() for chains in states.values()
                   for chain in chains.values() for ref in chain)

    @property
    def chain_count(self) -> int:
        return sum(len(chains) for states in self.keyed.values() for chains in states.values())

    @property
    def split_count(self) -> int:
        return sum(len(s) for s in self.source_splits.values())


@dataclass(frozen=True)
class RestorePlan:
    """The restore of checkpoint ``checkpoint_id`` into ``parallelism`` subtasks.

    ``previous_parallelism``: the parallelism the checkpoint was taken at, when the manifest
    records it (``stats.parallelism``). ``dropped``: snapshot content left out because the
    job no longer has it (only with ``allow_non_restored_state=True``).
    """

    checkpoint_id: int
    job_name: str
    max_parallelism: int
    parallelism: int
    subtasks: tuple[SubtaskPlan, ...]
    previous_parallelism: int | None = None
    operator_state_rules: dict[str, str] = field(default_factory=dict)
    dropped: tuple[str, ...] = ()

    # ------------------------------------------------------------------ figures
    @property
    def total_bytes(self) -> int:
        """Bytes read by all subtasks together (a file read by several subtasks counts each time)."""
        return sum(s.read_bytes for s in self.subtasks)

    @property
    def total_files(self) -> int:
        """Distinct files all subtasks read (a packed file, or a file read by several subtasks,
        counts once)."""
        return len({ref.path for s in self.subtasks for ref in s.files()})

    @property
    def total_references(self) -> int:
        """References the subtasks read, each subtask's counted apart: a file, or a key group's
        range of a packed file (:meth:`SubtaskPlan.files`)."""
        return sum(len(s.files()) for s in self.subtasks)

    @property
    def balance(self) -> float:
        """Max over mean of the bytes per subtask (1.0 = perfectly even; 1.0 when nothing is read)."""
        sizes = [s.read_bytes for s in self.subtasks]
        mean = sum(sizes) / len(sizes)
        return max(sizes) / mean if mean else 1.0

    # ------------------------------------------------------------------ for the runtime
    def routing_table(self) -> tuple[int, ...]:
        """``table[kg]`` = the subtask that restores (and then owns) key group ``kg``."""
        return routing_table(self.max_parallelism, self.parallelism)

    def keyed_chains(self, subtask: int) -> dict[str, dict[str, dict[int, list[FileRef]]]]:
        """``uid -> state -> key group -> chain`` of one subtask (the worker's ``keyed_chains``)."""
        return self.subtasks[subtask].keyed

    def sink_transactions(self) -> dict[str, list[Any]]:
        """``uid -> handles``: what every sink subtask re-commits (rule "union")."""
        return dict(self.subtasks[0].sink_transactions) if self.subtasks else {}

    def source_assignment(
        self, initial_offset: Callable[[str, str], Any] | None = None
    ) -> dict[str, dict[int, dict[str, Any]]]:
        """``uid -> subtask -> {split: offset}`` (the runtime's ``source_splits`` shape).

        ``initial_offset(uid, split)`` supplies the start of never-read splits; without it they
        keep ``None``."""
        out: dict[str, dict[int, dict[str, Any]]] = {}
        for sub in self.subtasks:
            for uid, splits in sub.source_splits.items():
                initial = set(sub.initial_splits.get(uid, ()))
                resolved = {
                    split: (initial_offset(uid, split) if split in initial and initial_offset is not None else offset)
                    for split, offset in splits.items()
                }
                out.setdefault(uid, {})[sub.index] = resolved
        return out

    # ------------------------------------------------------------------ printing
    def describe(self) -> str:
        """A readable table: per subtask its key groups, chains, files (distinct files; a packed
        file once), references (``refs``: files and key groups' ranges of packed files), bytes
        and share."""
        prev = self.previous_parallelism if self.previous_parallelism is not None else "?"
        lines = [
            f"restore plan: checkpoint {self.checkpoint_id} of job {self.job_name!r}, "
            f"max_parallelism {self.max_parallelism}, parallelism {prev} -> {self.parallelism}",
        ]
        total = self.total_bytes
        header = ("subtask", "key groups", "kgs", "chains", "files", "refs", "bytes", "share", "splits", "opstate",
                  "logs")
        rows = [header]
        for s in self.subtasks:
            nbytes = s.read_bytes
            rows.append((
                str(s.index), str(s.key_groups), str(len(s.key_groups)), str(s.chain_count), str(s.file_count),
                str(len(s.files())), human_bytes(nbytes), f"{100 * nbytes / total:.1f}%" if total else "-", str(s.split_count),
                str(sum(len(v) for v in s.operator_state.values())), str(len(s.channel_logs)),
            ))
        rows.append((
            "total", "", str(self.max_parallelism), str(sum(s.chain_count for s in self.subtasks)),
            str(self.total_files), str(self.total_references), human_bytes(total), "100.0%" if total else "-",
            str(sum(s.split_count for s in self.subtasks)),
            str(sum(len(v) for s in self.subtasks for v in s.operator_state.values())),
            str(sum(len(s.channel_logs) for s in self.subtasks)),
        ))
        widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
        for r in rows:
            lines.append("  ".join(cell.rjust(w) if c not in (1,) else cell.ljust(w)
                                   for c, (cell, w) in enumerate(zip(r, widths))).rstrip())
        if self.subtasks:
            heaviest = max(self.subtasks, key=lambda s: s.read_bytes)
            lines.append(f"balance: max/mean bytes per subtask {self.balance:.2f} "
                         f"(subtask {heaviest.index} reads {human_bytes(heaviest.read_bytes)})")
        for uid, txns in sorted(self.sink_transactions().items()):
            lines.append(f"sink {uid!r}: {len(txns)} transaction(s) handed to every subtask (union) to re-commit")
        for uid, rule in sorted(self.operator_state_rules.items()):
            lines.append(f"operator state {uid!r}: rule {rule!r}")
        for what in self.dropped:
            lines.append(f"not restored (allow_non_restored_state): {what}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


# ====================================================================== planning
def plan_restore(
    manifest: Manifest,
    fingerprint: Mapping[str, Any] | JobFingerprint | None,
    parallelism: int,
    *,
    source_splits: Mapping[str, Sequence[str]] | None = None,
    allow_non_restored_state: bool = False,
) -> RestorePlan:
    """Plan the restore of ``manifest`` into ``parallelism`` subtasks (pure; reads no file).

    ``fingerprint``: the job's (``Dataflow.fingerprint()``): only state the job declares is
    planned; ``None`` plans everything the snapshot holds (offline previews).
    ``source_splits``: ``uid -> split ids`` the job's sources know now (the enumerators'
    ``splits()``); united with the snapshot's splits. Raises
    :class:`~recovery.errors.IncompatibleSnapshotError` for what :func:`check_manifest`
    finds fatal (``max_parallelism`` mismatch, parallelism out of bounds, state the job lost
    unless ``allow_non_restored_state``, unknown operator-state rules, malformed content).
    """
    check_manifest(fingerprint, manifest, parallelism=parallelism,
                   allow_non_restored_state=allow_non_restored_state).raise_if_fatal()
    m, p = manifest.max_parallelism, parallelism
    check_parallelism(m, p)
    job = None if fingerprint is None else JobFingerprint.parse(fingerprint)
    selection = select(job, manifest)
    subs = [_Builder(i, key_group_range(m, p, i)) for i in range(p)]

    for uid, states in selection.keyed.items():
        for state in states:
            for kg, chain in sorted(manifest.keyed[uid][state].items()):
                if not 0 <= kg < m:
                    raise IncompatibleSnapshotError(
                        f"checkpoint {manifest.checkpoint_id}: {uid}/{state} has a chain for key group {kg}, outside "
                        f"[0, {m}) of its max_parallelism {m}; the manifest is corrupt; restore from another checkpoint"
                    )
                owner = subs[kg * p // m]
                assert kg in owner.key_groups
                owner.keyed.setdefault(uid, {}).setdefault(state, {})[kg] = list(chain)

    _plan_sources(subs, manifest, selection.sources, source_splits or {})

    for uid in selection.sinks:
        txns = sink_transactions_in_order(manifest.sink_transactions[uid])
        for sub in subs:
            sub.sink_transactions[uid] = list(txns)

    rules = {uid: manifest.operator_state_rules[uid] for uid in selection.operator_state}
    for uid in selection.operator_state:
        files = [ref for _, ref in sorted(manifest.operator_state[uid].items())]
        if rules[uid] == "split":
            for k, ref in enumerate(files):
                subs[k % p].operator_state.setdefault(uid, []).append(ref)
        else:  # union, broadcast
            for sub in subs:
                sub.operator_state[uid] = list(files)

    for k, ref in enumerate(manifest.channel_logs):
        task = ref.location().task or ""
        match = _TASK_SUBTASK.search(task)
        subs[(int(match.group(1)) if match else k) % p].channel_logs.append(ref)

    previous = manifest.stats.get("parallelism")
    dropped = tuple(
        f"{d.uid}: {d.holds}" if d.state is None else f"{d.uid}/{d.state}: {d.holds}" for d in selection.dropped
    )
    return RestorePlan(
        checkpoint_id=manifest.checkpoint_id,
        job_name=manifest.job_name,
        max_parallelism=m,
        parallelism=p,
        subtasks=tuple(b.build() for b in subs),
        previous_parallelism=previous if type(previous) is int else None,
        operator_state_rules=rules,
        dropped=dropped,
    )


def _plan_sources(subs: list["_Builder"], manifest: Manifest, restored_uids: Iterable[str],
                  known: Mapping[str, Sequence[str]]) -> None:
    p = len(subs)
    restored_uids = set(restored_uids)
    for uid in sorted(restored_uids | set(known)):
        restored = source_offsets_of(manifest.source_offsets[uid]) if uid in restored_uids else {}
        now = known.get(uid, ())
        if isinstance(now, str):
            raise TypeError(f"source_splits[{uid!r}] must be a list of split ids, got the string {now!r}")
        splits = sorted(set(map(str, now)) | set(restored))
        for sub in subs:
            sub.source_splits[uid] = {}
            sub.initial[uid] = []
        for j, split in enumerate(splits):
            sub = subs[j % p]
            if split in restored:
                sub.source_splits[uid][split] = restored[split]
            else:
                sub.source_splits[uid][split] = None
                sub.initial[uid].append(split)


@dataclass
class _Builder:
    index: int
    key_groups: KeyGroupRange
    keyed: dict = field(default_factory=dict)
    source_splits: dict = field(default_factory=dict)
    initial: dict = field(default_factory=dict)
    sink_transactions: dict = field(default_factory=dict)
    operator_state: dict = field(default_factory=dict)
    channel_logs: list = field(default_factory=list)

    def build(self) -> SubtaskPlan:
        return SubtaskPlan(
            index=self.index, key_groups=self.key_groups, keyed=self.keyed, source_splits=self.source_splits,
            initial_splits={uid: tuple(s) for uid, s in self.initial.items()},
            sink_transactions=self.sink_transactions, operator_state=self.operator_state,
            channel_logs=self.channel_logs,
        )
