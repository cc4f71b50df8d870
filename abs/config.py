"""Configuration objects, passed explicitly (never read from the environment)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from abs.errors import ConfigError

__all__ = ["CheckpointConfig", "RestartStrategy", "CHECKPOINT_MODES"]

CHECKPOINT_MODES = ("aligned", "unaligned", "stop_the_world")
"""``aligned``: Asynchronous Barrier Snapshotting (the product). ``unaligned``: the barrier
overtakes the records queued in front of it, which are stored with the checkpoint as its
channel state (:mod:`abs.runtime.unaligned`). ``stop_the_world``: pause every source, drain,
snapshot everything, resume; a benchmark baseline only."""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class CheckpointConfig:
    """When and how checkpoints are taken.

    * ``interval``: seconds between periodic checkpoint triggers; ``None`` turns periodic
      checkpoints off (on-request checkpoints and savepoints still work).
    * ``timeout``: seconds after its trigger at which a checkpoint that has not received every
      acknowledgement is aborted.
    * ``min_pause``: minimum seconds between the end (completion or abort) of one checkpoint
      and the periodic trigger of the next. When positive, at most one checkpoint is in flight
      at a time whatever ``max_concurrent`` says (as in Flink).
    * ``max_concurrent``: checkpoints in flight at once (triggered, not yet completed or
      aborted).
    * ``retained``: completed checkpoints kept by retention (savepoints are pinned apart).
    * ``mode``: ``"aligned"``, ``"unaligned"`` (a task snapshots at the first barrier it hears
      of, which overtakes the queued records; those records are stored with the checkpoint and
      replayed on restore: short checkpoints under backpressure) or ``"stop_the_world"``
      (benchmark baseline only).
    * ``alignment_timeout``: with ``mode="aligned"``, seconds a task may spend aligning a
      checkpoint before it switches to unaligned for that checkpoint (``None``: never).
    * ``tolerable_failures``: consecutive failed checkpoints (timeouts, declines, failed
      commits) tolerated before the job fails over (through the :class:`RestartStrategy`;
      it fails when no restart is left); ``None`` tolerates any number.
    """

    interval: float | None = None
    timeout: float = 600.0
    min_pause: float = 0.0
    max_concurrent: int = 1
    retained: int = 3
    mode: str = "aligned"
    tolerable_failures: int | None = None
    alignment_timeout: float | None = None

    def __post_init__(self) -> None:
        if self.interval is not None and not (_is_number(self.interval) and self.interval > 0):
            raise ConfigError(
                f"CheckpointConfig.interval must be a positive number of seconds or None, got "
                f"{self.interval!r}; pass e.g. interval=1.0, or None to turn periodic "
                "checkpoints off"
            )
        if not (_is_number(self.timeout) and self.timeout > 0):
            raise ConfigError(
                f"CheckpointConfig.timeout must be a positive number of seconds, got "
                f"{self.timeout!r}; pass e.g. timeout=600.0"
            )
        if not (_is_number(self.min_pause) and self.min_pause >= 0):
            raise ConfigError(
                f"CheckpointConfig.min_pause must be a number of seconds >= 0, got "
                f"{self.min_pause!r}; pass e.g. min_pause=0.0"
            )
        if not (_is_int(self.max_concurrent) and self.max_concurrent >= 1):
            raise ConfigError(
                f"CheckpointConfig.max_concurrent must be an int >= 1, got "
                f"{self.max_concurrent!r}; pass e.g. max_concurrent=1"
            )
        if not (_is_int(self.retained) and self.retained >= 1):
            raise ConfigError(
                f"CheckpointConfig.retained must be an int >= 1, got {self.retained!r}; "
                "pass e.g. retained=3"
            )
        if self.mode not in CHECKPOINT_MODES:
            raise ConfigError(
                f"CheckpointConfig.mode must be one of {', '.join(map(repr, CHECKPOINT_MODES))}, "
                f"got {self.mode!r}; use 'aligned' or 'unaligned' ('stop_the_world' is a benchmark baseline)"
            )
        if self.alignment_timeout is not None:
            if not (_is_number(self.alignment_timeout) and self.alignment_timeout >= 0):
                raise ConfigError(
                    f"CheckpointConfig.alignment_timeout must be a number of seconds >= 0 or None, got "
                    f"{self.alignment_timeout!r}; pass e.g. alignment_timeout=0.5"
                )
            if self.mode != "aligned":
                raise ConfigError(
                    f"CheckpointConfig.alignment_timeout applies to mode='aligned' (a slow alignment switches to "
                    f"unaligned), not to mode={self.mode!r}; leave it None"
                )
        if self.mode == "stop_the_world" and self.max_concurrent != 1:
            raise ConfigError(
                f"CheckpointConfig.max_concurrent must be 1 with mode='stop_the_world', got "
                f"{self.max_concurrent!r}; the baseline pauses the whole job per checkpoint"
            )
        if self.tolerable_failures is not None and not (
            _is_int(self.tolerable_failures) and self.tolerable_failures >= 0
        ):
            raise ConfigError(
                f"CheckpointConfig.tolerable_failures must be an int >= 0 or None, got "
                f"{self.tolerable_failures!r}; pass e.g. tolerable_failures=3, or None to "
                "tolerate any number"
            )


    @property
    def priority_barriers(self) -> bool:
        """Senders announce barriers ahead of the queued records (unaligned, or aligned with a
        timeout that may switch to unaligned)."""
        return self.mode == "unaligned" or self.alignment_timeout is not None


@dataclass(frozen=True)
class RestartStrategy:
    """How the driver recovers from a failure (a worker that dies or hangs, a user function
    that raises): stop every worker, restore the newest checkpoint of this run that can be
    restored (falling back past broken ones, to what the run started from: the checkpoint or
    savepoint it restored, or empty state) and relaunch; sinks are rolled back to the
    checkpoint restored first (see ``abs.run``'s ``restore``), at most ``max_restarts`` times, waiting
    ``delay`` seconds before the first restart and ``backoff`` times longer before each next
    one, up to ``max_delay``. The default makes no restart: the job fails with an error that
    names the failed worker or operator.

    ``min_workers``: when a restart finds fewer free task slots than the job has workers (a
    Spark executor or a whole host lost and not replaced within ``SparkExecutor.slot_wait``),
    go on with as many workers as there are slots, but not fewer than ``min_workers``: the
    checkpoint is restored into the smaller parallelism (key groups re-divided). Once the
    slots are back, the job returns to its parallelism by a live rescale (unless an
    :class:`abs.Autoscale` decides the parallelism). Default ``None``: a restart waits for
    every slot, then fails naming the free and needed slots. Executors whose workers always
    start (the local one) never go below the job's parallelism.
    """

    max_restarts: int = 0
    delay: float = 0.5
    backoff: float = 2.0
    max_delay: float = 30.0
    min_workers: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_restarts) or self.max_restarts < 0:
            raise ConfigError(f"RestartStrategy.max_restarts must be an integer >= 0, got {self.max_restarts!r}")
        for name in ("delay", "max_delay"):
            value = getattr(self, name)
            if not _is_number(value) or value < 0:
                raise ConfigError(f"RestartStrategy.{name} must be a finite number of seconds >= 0, got {value!r}")
        if not _is_number(self.backoff) or self.backoff < 1:
            raise ConfigError(f"RestartStrategy.backoff must be a number >= 1, got {self.backoff!r}")
        if self.min_workers is not None and not (_is_int(self.min_workers) and self.min_workers >= 1):
            raise ConfigError(f"RestartStrategy.min_workers must be an integer >= 1 or None, got {self.min_workers!r}; "
                              "None keeps the job's parallelism on every restart")

    def delay_before(self, restart: int) -> float:
        """Seconds to wait before restart number ``restart`` (1-based)."""
        return min(self.max_delay, self.delay * self.backoff ** (restart - 1))
