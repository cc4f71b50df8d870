"""Pure planning of a reconfiguration: the key-group assignment, the checks a request must
pass, and the steps a strategy cuts a change into.

An *assignment* maps every key group ``0 .. M-1`` to the worker that owns it. A change is a
target assignment over the same workers; :func:`plan_steps` returns the moves that turn one
into the other, grouped into steps:

* ``"all_at_once"``: one step with every move;
* ``"batched"``: steps of ``batch`` moves each (the last may be smaller);
* ``"fluid"``: one key group per step, the next once the previous is installed.

Moves are ordered by key group, so a plan is a pure function of its inputs.

A *rescale* (:func:`plan_rescale`) changes the number of workers as well. Growing from ``P``
to ``P'`` workers: the first step also *joins* workers ``P .. P'-1`` (their channels enter
the dataflow at its marker), then the key groups move to them, fewest moves first
(:func:`rescale_target`: every worker keeps what it has up to its share). Shrinking: the key
groups of workers ``P' .. P-1`` move to the others, then a *drain* step hands the leaving
workers' source splits over and stops routing to them, and a *retire* step (after a checkpoint
that commits what their sinks wrote) ends their channels; then they stop.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from ..errors import ReconfigurationError
from abscore.ids import id_ranges

from ..keygroups import routing_table

__all__ = ["Assignment", "Move", "Step", "STRATEGIES", "ReconfigurationError", "plan_steps",
           "move_target", "rebalance_target", "check_strategy", "rescale_target", "plan_rescale", "spread_splits",
           "JOIN", "DRAIN", "RETIRE"]

JOIN, DRAIN, RETIRE = "join", "drain", "retire"
"""Kinds of rescale steps (:attr:`Step.phase`); a step with no phase only moves key groups."""

STRATEGIES = ("all_at_once", "batched", "fluid")


@dataclass(frozen=True)
class Move:
    """Key group ``key_group`` moves from worker ``source`` to worker ``target``."""

    key_group: int
    source: int
    target: int


@dataclass(frozen=True)
class Step:
    """Step ``index`` (1-based within its reconfiguration) of a reconfiguration: its moves."""

    index: int
    moves: tuple[Move, ...]
    workers: int = 0  # the number of workers from this step on (0: unchanged)
    phase: str = ""  # JOIN, DRAIN, RETIRE, or "" (moves only)

    @property
    def key_groups(self) -> tuple[int, ...]:
        return tuple(mv.key_group for mv in self.moves)


@dataclass(frozen=True)
class Assignment:
    """Owner (worker index) of every key group; ``workers``: how many workers there are."""

    owners: tuple[int, ...]
    workers: int

    @classmethod
    def initial(cls, max_parallelism: int, parallelism: int) -> "Assignment":
        """Contiguous ranges, as a job starts (``abs.keygroups.key_group_range``)."""
        return cls(tuple(int(w) for w in routing_table(max_parallelism, parallelism)), parallelism)

    @property
    def max_parallelism(self) -> int:
        return len(self.owners)

    def key_groups_of(self, worker: int) -> tuple[int, ...]:
        return tuple(kg for kg, w in enumerate(self.owners) if w == worker)

    def applied(self, moves: Iterable[Move]) -> "Assignment":
        owners = list(self.owners)
        for mv in moves:
            if owners[mv.key_group] != mv.source:
                raise ReconfigurationError(
                    f"key group {mv.key_group} is owned by worker {owners[mv.key_group]}, not worker "
                    f"{mv.source}; the move was planned against another assignment (a bug: report it)"
                )
            owners[mv.key_group] = mv.target
        return Assignment(tuple(owners), self.workers)

    def widened(self, workers: int) -> "Assignment":
        """The same owners over ``workers`` workers (a rescale's view before and after)."""
        return Assignment(self.owners, workers)

    def describe(self) -> str:
        """Compact ranges per worker, e.g. ``w0: 0-31,40; w1: 32-39,41-63``."""
        parts = []
        for w in range(self.workers):
            kgs = self.key_groups_of(w)
            parts.append(f"w{w}: {id_ranges(kgs, sep=',') or '-'}")
        return "; ".join(parts)


def check_strategy(strategy: object, batch: object) -> int:
    """The batch size ``strategy`` implies (1 for fluid, 0 for all at once)."""
    if strategy not in STRATEGIES:
        raise ReconfigurationError(
            f"strategy={strategy!r} is not a reconfiguration strategy; use one of {', '.join(STRATEGIES)}"
        )
    if strategy == "batched":
        if type(batch) is not int or batch < 1:
            raise ReconfigurationError(
                f"strategy='batched' needs batch=N, a positive int (key groups per step); got batch={batch!r}"
            )
        return batch
    if batch is not None:
        raise ReconfigurationError(f"batch={batch!r} is only for strategy='batched' (strategy={strategy!r})")
    return 1 if strategy == "fluid" else 0


def _integer(value: object) -> int | None:
    """``value`` as an int when it is an integer (a numpy integer too: key groups and workers
    picked from arrays), not a bool; else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def _check_worker(worker: object, workers: int, what: str) -> int:
    index = _integer(worker)
    if index is None or not 0 <= index < workers:
        raise ReconfigurationError(
            f"{what}={worker!r} is not a worker of this job; use a worker index in [0, {workers - 1}]"
        )
    return index


def _check_key_group(kg: object, max_parallelism: int) -> int:
    index = _integer(kg)
    if index is None:
        raise ReconfigurationError(
            f"key group {kg!r} is not a key group id: key groups are ints 0 .. {max_parallelism - 1} "
            f"(max_parallelism={max_parallelism})"
        )
    if not 0 <= index < max_parallelism:
        raise ReconfigurationError(
            f"key group {kg!r} does not exist; this job has key groups 0 .. {max_parallelism - 1} "
            f"(max_parallelism={max_parallelism})"
        )
    return index


def move_target(current: Assignment, key_groups: Iterable[int], to: int) -> Assignment:
    """The assignment after moving ``key_groups`` to worker ``to``."""
    to = _check_worker(to, current.workers, "to")
    kgs = list(key_groups) if not isinstance(key_groups, (str, bytes)) else None
    if not kgs:
        raise ReconfigurationError(f"move({key_groups!r}, to={to}): name at least one key group to move")
    owners = list(current.owners)
    for kg in kgs:
        owners[_check_key_group(kg, current.max_parallelism)] = to
    return Assignment(tuple(owners), current.workers)


def rebalance_target(current: Assignment, assignment: Mapping[int, int] | Sequence[int]) -> Assignment:
    """The assignment a ``rebalance`` asks for: a full owner list (one worker per key group) or
    a mapping key group -> worker for the key groups that change."""
    M = current.max_parallelism
    owners = list(current.owners)
    if isinstance(assignment, Mapping):
        items = list(assignment.items())
    elif isinstance(assignment, Sequence) and not isinstance(assignment, (str, bytes)):
        if len(assignment) != M:
            raise ReconfigurationError(
                f"rebalance: a full assignment lists one worker per key group ({M}), got {len(assignment)}; "
                "pass a list of that length or a dict {key_group: worker} of the changes"
            )
        items = list(enumerate(assignment))
    else:
        raise ReconfigurationError(
            f"rebalance: expected a list of {M} worker indexes or a dict {{key_group: worker}}, got "
            f"{type(assignment).__name__}"
        )
    for kg, w in items:
        owners[_check_key_group(kg, M)] = _check_worker(w, current.workers, f"worker of key group {kg}")
    return Assignment(tuple(owners), current.workers)


def plan_steps(current: Assignment, target: Assignment, strategy: str = "all_at_once",
               batch: int | None = None) -> tuple[Step, ...]:
    """The steps that turn ``current`` into ``target`` (see the module docstring). No step when
    nothing changes."""
    size = check_strategy(strategy, batch)
    if target.max_parallelism != current.max_parallelism or target.workers != current.workers:
        raise ReconfigurationError(
            f"the target assignment has {target.max_parallelism} key groups over {target.workers} workers, "
            f"the job {current.max_parallelism} over {current.workers}"
        )
    moves = [Move(kg, a, b) for kg, (a, b) in enumerate(zip(current.owners, target.owners)) if a != b]
    if not moves:
        return ()
    if size == 0:
        size = len(moves)
    return tuple(Step(i + 1, tuple(moves[k:k + size])) for i, k in enumerate(range(0, len(moves), size)))


def rescale_target(current: Assignment, workers: int) -> Assignment:
    """The assignment over ``workers`` workers that moves the fewest key groups: each worker's
    share is ``M // workers`` or one more (the lower workers take the extra ones); a worker
    keeps its own key groups up to its share (its lowest first) and gives the rest, key groups
    of workers that leave included, to the workers below their share, lowest key group first."""
    M = current.max_parallelism
    if type(workers) is not int or not 1 <= workers <= M:
        raise ReconfigurationError(
            f"rescale({workers!r}): the number of workers must be an int in [1, {M}] (max_parallelism={M}; "
            "more workers than key groups would leave some without state: re-key offline to a larger "
            "max_parallelism first)"
        )
    share = [M // workers + (1 if w < M % workers else 0) for w in range(workers)]
    owners: list[int | None] = [None] * M
    kept = [0] * workers
    for kg, w in enumerate(current.owners):
        if w < workers and kept[w] < share[w]:
            owners[kg] = w
            kept[w] += 1
    free = [kg for kg in range(M) if owners[kg] is None]
    w = 0
    for kg in free:
        while kept[w] >= share[w]:
            w += 1
        owners[kg] = w
        kept[w] += 1
    return Assignment(tuple(int(o) for o in owners), workers)  # type: ignore[arg-type]


def plan_rescale(current: Assignment, workers: int, strategy: str = "all_at_once",
                 batch: int | None = None) -> tuple[Assignment, tuple[Step, ...]]:
    """The target assignment and the steps of a rescale to ``workers`` workers (see the module
    docstring): growing, the first step joins the new workers (and carries the first moves);
    shrinking, the moves are followed by a drain step and a retire step."""
    check_strategy(strategy, batch)
    P = current.workers
    target = rescale_target(current, workers)
    if workers == P:
        raise ReconfigurationError(f"rescale({workers}): the job runs {P} workers already; nothing to change")
    if workers > P:
        moves = plan_steps(current.widened(workers), target, strategy, batch)
        if not moves:  # no key group to move (cannot happen with workers <= M): join alone
            return target, (Step(1, (), workers, JOIN),)
        first = Step(1, moves[0].moves, workers, JOIN)
        return target, (first,) + moves[1:]
    moves = plan_steps(current, target.widened(P), strategy, batch)
    n = len(moves)
    return target, moves + (Step(n + 1, (), workers, DRAIN), Step(n + 2, (), workers, RETIRE))


def spread_splits(owners: Mapping[str, int], workers: int) -> list[tuple[int, int, tuple[str, ...]]]:
    """Source splits to hand over so that ``workers`` workers read about as many splits each
    (``owners``: split -> worker, of one source): ``(from, to, splits)`` moves, the fewest
    that even the counts out (a worker keeps its own splits up to its share, the lowest
    first; a worker at or past ``workers`` keeps none)."""
    splits = sorted(owners, key=lambda s: (owners[s], str(s)))
    n = len(splits)
    share = [n // workers + (1 if w < n % workers else 0) for w in range(workers)]
    kept = [0] * workers
    free: list[str] = []
    for s in splits:
        w = owners[s]
        if w < workers and kept[w] < share[w]:
            kept[w] += 1
        else:
            free.append(s)
    moves: dict[tuple[int, int], list[str]] = {}
    w = 0
    for s in free:
        while kept[w] >= share[w]:
            w += 1
        kept[w] += 1
        moves.setdefault((owners[s], w), []).append(s)
    return [(a, b, tuple(ss)) for (a, b), ss in sorted(moves.items())]
