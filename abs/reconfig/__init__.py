"""Live reconfiguration: move key groups between the running workers of a job.

A reconfiguration is a sequence of *steps*; step ``r`` moves some key groups from their
owner to a new one. Its parts, one module each:

* :mod:`abs.reconfig.plan` -- pure: the assignment (key group -> worker), requests checked
  against it, and the steps a strategy cuts a change into (``all_at_once``, ``batched``,
  ``fluid``);
* :mod:`abs.reconfig.aligner` -- pure: the alignment of a step's control barrier at a task
  with several input channels (never aborted, unlike a checkpoint's);
* :mod:`abs.reconfig.holding` -- the records of key groups whose state has not arrived yet,
  held at their new owner in arrival order;
* :mod:`abs.reconfig.coordinator` -- pure, in the driver: which step runs, what it waits for
  (every task applied it, every moved key group installed), and the history the job reports.

The protocol (the README's architecture tour has the picture): the driver sends step ``r``
to the source tasks, which inject a :class:`~abs.runtime.channels.StepMarker` like a
checkpoint barrier. Every task aligns it; at that moment it (1) hands over the moving key
groups it owns (their state: what changed since the last completed checkpoint plus that
checkpoint's chains, or the whole key group) and forgets them, (2) starts holding records of
the key groups it gains, and (3) forwards the marker on every output and switches its routing
to the new owners in the same step, so every record before the marker goes to the old owner
and every record after it to the new one. The new owner installs a key group's state (from its
pre-loaded copy of the checkpoint's chains plus the changes that travelled) and then processes
the held records in order.
"""
from .coordinator import ReconfigurationRecord, StepRecord
from .plan import Assignment, Move, ReconfigurationError, Step, plan_steps

__all__ = ["Assignment", "Move", "Step", "ReconfigurationError", "ReconfigurationRecord", "StepRecord", "plan_steps"]
