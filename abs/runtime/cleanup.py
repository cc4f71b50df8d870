"""Retention GC off the driver's loop: a thread that runs the newest request.

Why: the coordinator's loop receives acks, commits manifests and sends triggers and
completion notices. A GC lists the root, reads manifests and deletes files: on an object
store that took 100-200 ms per checkpoint (1.4 s for a job's last one) on a loopback S3
server, time in which no ack was read and no notice went out.

Requests coalesce: while a GC runs, a newer request replaces an older waiting one (the newer
one covers the older one's garbage). Each request names the checkpoint whose commit asked
for it (``as_of``): the store then plans as if that checkpoint were still the newest, so a
GC that runs behind later commits never drops a checkpoint that a checkpoint pending at
request time builds on (see :meth:`storage.SnapshotStore.plan_gc`). A failed GC logs a
warning and deletes nothing more; the next request retries (deletes are idempotent). A
corrupt manifest does not stop GC (it is not trusted and protects nothing, see
:mod:`storage.gc`); it is reported once per job, not at every checkpoint.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

__all__ = ["BackgroundGc", "GcRequest"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GcRequest:
    store: Any  # storage.SnapshotStore
    retain: int
    in_flight: tuple
    as_of: int


class BackgroundGc:
    """One daemon thread, started on the first request."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting: GcRequest | None = None
        self._running = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._reported: set = set()  # corrupt manifests and bad pins already warned about

    def submit(self, request: GcRequest) -> None:
        """Queue ``request`` (replacing a waiting one); returns at once."""
        with self._cond:
            if self._closed:
                return
            self._waiting = request
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="abs-gc", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def run_now(self, request: GcRequest) -> None:
        """Run ``request`` in the calling thread (after a running one). For ``memory://``
        roots: fsspec's memory file system is a shared dict that a listing iterates, so a
        listing beside a concurrent write can fail; and a GC there takes no time."""
        with self._cond:
            self._cond.wait_for(lambda: not self._running)
            self._running = True
        self._execute(request)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until no GC waits or runs; False if ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._waiting is None and not self._running, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Finish the waiting request, then stop the thread; False if ``timeout`` passed first."""
        done = self.drain(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if done and thread is not None:
            thread.join(timeout)
        return done

    def _run(self) -> None:
        while True:
            with self._cond:
                # one GC at a time, also beside run_now
                self._cond.wait_for(lambda: (self._waiting is not None and not self._running) or self._closed)
                if self._waiting is None or self._running:
                    return  # closed
                request, self._waiting = self._waiting, None
                self._running = True
            self._execute(request)

    def _execute(self, request: GcRequest) -> None:
        try:
            plan = request.store.gc(request.retain, in_flight=request.in_flight, as_of=request.as_of)
            for key, reason in (*plan.corrupt, *plan.bad_pins):
                if key not in self._reported:
                    self._reported.add(key)
                    what = f"checkpoint {key}: manifest" if isinstance(key, int) else f"pin {key}"
                    log.warning("%s: %s is corrupt (%s); it is not trusted and protects no file; garbage "
                                "collection goes on; inspect it with 'abs-snapshot verify'", request.store.url, what, reason)
        except Exception as exc:  # noqa: BLE001 - GC failures never fail a checkpoint
            log.warning("garbage collection after checkpoint %s failed (%s); files are kept", request.as_of, exc)
        finally:
            with self._cond:
                self._running = False
                self._cond.notify_all()
