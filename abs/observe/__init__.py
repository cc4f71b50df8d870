"""Seeing a job: the live dashboard (:class:`Dashboard`, :mod:`abs.observe.server`), its
Prometheus endpoint (:mod:`abs.observe.prometheus`), the offline HTML report of a snapshot
root (:mod:`abs.observe.report`) and progress events of long operations
(:mod:`abs.observe.progress`).

The runtime hands this package two things only: a callable that returns the job's facts
(:func:`abs.observe.snapshot.job_snapshot` of its driver) and the callables that take a
checkpoint or a savepoint (the job's :class:`~abs.JobHandle` methods).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

from abscore.lazy import lazy_names as _lazy_names

if TYPE_CHECKING:  # at run time the names load on first use (below)
    from .server import Dashboard, DashboardServer
    from .snapshot import job_snapshot

__all__ = ["Dashboard", "DashboardServer", "job_snapshot", "start_dashboard"]

# Every driver imports abs.observe.snapshot (the checkpoints' figures); the dashboard's HTTP
# server (http.server, http.client, ssl, email) loads only in a driver that serves one.
__getattr__, __dir__ = _lazy_names(__name__, globals(), {".server": ("Dashboard", "DashboardServer"),
                                                         ".snapshot": ("job_snapshot",)})

log = logging.getLogger(__name__)


def start_dashboard(driver: Any, options: Dashboard, *, checkpoint: Callable[[], int] | None = None,
                    savepoint: Callable[[], str] | None = None) -> DashboardServer:
    """Serve the dashboard of ``driver``'s job; logs its URL (at INFO) and returns the server
    (``.url``, ``.stop()``). Savepoints are offered only to a job with storage."""
    from .server import DashboardServer
    from .snapshot import job_snapshot

    server = DashboardServer(lambda limit: job_snapshot(driver, limit=limit), options=options,
                             checkpoint=checkpoint if driver.checkpointing else None,
                             savepoint=savepoint if driver.checkpointing else None)
    url = server.start()
    log.info(f"[abs] job {driver.flow.name!r}: dashboard at {url}")
    return server
