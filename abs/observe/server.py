"""The live dashboard of a job: a small HTTP server in a daemon thread of the driver's
process (standard library ``http.server``), loopback by default.

Every request needs the job's token, in the query (``?token=...``, as in the URL the job
logs) or as ``Authorization: Bearer ...`` (for a Prometheus scrape config); without it the
answer is 403. Routes:

* ``GET /``: the page (:mod:`abs.observe.page`), which refreshes itself from ``/api/job``;
* ``GET /api/job``: the job as JSON (:func:`abs.observe.snapshot.job_snapshot`) plus
  records per second per operator since the previous request (at the first, since the job
  started);
* ``GET /metrics``: Prometheus' text format (:mod:`abs.observe.prometheus`);
* ``POST /api/checkpoint`` and ``POST /api/savepoint``: take one, answer when it is done.
"""
from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import secrets
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit

from ..errors import ConfigError

log = logging.getLogger(__name__)

__all__ = ["Dashboard", "DashboardServer"]

DEFAULT_HISTORY = 100
"""Completed checkpoints ``/api/job`` lists by default (the newest; counts cover all)."""


@dataclasses.dataclass(frozen=True)
class Dashboard:
    """Where a job's dashboard listens: ``abs.submit(..., dashboard=abs.observe.Dashboard(
    host="0.0.0.0", port=8081))``; ``dashboard=True`` is ``Dashboard()`` (loopback, a free
    port). ``token``: the secret every request must carry (default: a new random one per job).
    Listening beyond loopback lets anyone who learns the URL trigger checkpoints and
    savepoints: keep the token secret."""

    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ConfigError(f"Dashboard.host must be a host name or address, got {self.host!r}")
        if not isinstance(self.port, int) or isinstance(self.port, bool) or not 0 <= self.port <= 65535:
            raise ConfigError(f"Dashboard.port must be an integer in [0, 65535] (0: any free port), got {self.port!r}")
        if self.token is not None and (not isinstance(self.token, str) or len(self.token) < 16):
            raise ConfigError("Dashboard.token must be a string of at least 16 characters (or None for a random one)")

    @classmethod
    def parse(cls, value: Any) -> "Dashboard | None":
        """``dashboard=`` of :func:`abs.run` / :func:`abs.submit`: ``None``/``False`` (off),
        ``True`` (loopback), ``"HOST:PORT"``, or a :class:`Dashboard`."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            host, sep, port = value.rpartition(":")
            if sep and host and port.isdigit():
                return cls(host=host.strip("[]"), port=int(port))
        raise ConfigError(f"dashboard must be True, 'HOST:PORT' or an abs.observe.Dashboard, got {value!r}")


class _ThreadingHTTPServerV6(ThreadingHTTPServer):
    address_family = socket.AF_INET6


class _Rates:
    """Records per second per operator between two snapshots at least ``min_gap`` s apart; at
    the first snapshot, the mean since the job started (``uptime`` seconds ago; 0 when it
    has just started), so that the first answer (and the first scrape) has a rate too."""

    def __init__(self, clock: Callable[[], float], min_gap: float = 1.0) -> None:
        self.clock, self.min_gap = clock, min_gap
        self._last: tuple[float, dict] | None = None
        self._rates: dict[str, float] = {}
        self._lock = threading.Lock()

    def update(self, records: dict[str, int], uptime: float | None = None) -> dict[str, float]:
        now = self.clock()
        with self._lock:
            if self._last is None:
                self._last = (now, dict(records))
                self._rates = {uid: n / uptime if uptime else 0.0 for uid, n in records.items()}
            elif now - self._last[0] >= self.min_gap:
                t0, before = self._last
                self._rates = {uid: max(0.0, (n - before.get(uid, 0)) / (now - t0)) for uid, n in records.items()}
                self._last = (now, dict(records))
            return dict(self._rates)


class DashboardServer:
    """Serves one job's dashboard. ``snapshot(limit)`` returns the job as a dict;
    ``checkpoint()`` and ``savepoint()`` take one and return its id / location (they block
    until it is done; ``None``: the action is not offered)."""

    def __init__(self, snapshot: Callable[[int], dict], *, options: Dashboard | None = None,
                 checkpoint: Callable[[], int] | None = None, savepoint: Callable[[], str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.options = options or Dashboard()
        self.token = self.options.token or secrets.token_urlsafe(24)
        self._snapshot = snapshot
        self._actions = {"checkpoint": checkpoint, "savepoint": savepoint}
        self._rates = _Rates(clock)
        self._registry: Any = None  # the job's prometheus_client registry, made on the first scrape
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        # set by stop(): a browser's keep-alive connection outlives the listening socket, and
        # its thread would go on answering; it gets one last answer (the ended job), then closes
        self.stopped = threading.Event()

    # ------------------------------------------------------------------ life
    def start(self) -> str:
        """Listen and serve in a daemon thread; returns the dashboard's URL (with its token)."""
        server: type[ThreadingHTTPServer] = ThreadingHTTPServer
        if ":" in self.options.host:  # an IPv6 address ("[::1]:8081" parses to "::1"): the server binds IPv4 else
            server = _ThreadingHTTPServerV6
        try:
            httpd = server((self.options.host, self.options.port), _handler(self))
        except OSError as exc:
            raise ConfigError(f"dashboard: cannot listen on {self.options.host}:{self.options.port} ({exc}); "
                              "pick another address or port=0 for any free one") from exc
        httpd.daemon_threads = True
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="abs-dashboard", daemon=True)
        self._thread.start()
        return self.url

    def stop(self) -> None:
        self.stopped.set()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    @property
    def address(self) -> tuple[str, int]:
        if self._httpd is None:
            raise RuntimeError("the dashboard is not running")
        host, port = self._httpd.server_address[:2]
        return str(host), int(port)

    @property
    def base_url(self) -> str:
        host, port = self.address
        return f"http://{'[' + host + ']' if ':' in host else host}:{port}"

    @property
    def url(self) -> str:
        return f"{self.base_url}/?token={self.token}"

    # ------------------------------------------------------------------ answers
    def allowed(self, query_token: str | None, authorization: str | None) -> bool:
        given = query_token
        if given is None and authorization and authorization.lower().startswith("bearer "):
            given = authorization[7:].strip()
        return given is not None and hmac.compare_digest(given.encode(), self.token.encode())

    def job(self, limit: int = DEFAULT_HISTORY) -> dict:
        snap = self._snapshot(limit)
        snap["throughput"] = self._rates.update(snap.get("records_in", {}), snap.get("uptime_s"))
        snap["actions"] = sorted(name for name, fn in self._actions.items() if fn is not None)
        return snap

    def metrics(self) -> tuple[bytes, str]:
        from .prometheus import PER_CHECKPOINT_SERIES, exposition, job_registry

        if self._registry is None:
            self._registry = job_registry(lambda: self.job(PER_CHECKPOINT_SERIES))
        return exposition(self._registry)

    def act(self, name: str) -> tuple[int, dict]:
        fn = self._actions.get(name)
        if fn is None:
            return 404, {"error": f"no action {name!r} on this job"}
        try:
            value = fn()
        except Exception as exc:  # noqa: BLE001 - the page shows why
            return 409, {"error": f"{type(exc).__name__}: {exc}"}
        return 200, {"checkpoint_id": value} if name == "checkpoint" else {"location": value}


def _handler(server: DashboardServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "abs-dashboard"
        protocol_version = "HTTP/1.1"
        timeout = 60  # an idle keep-alive connection is closed (the page asks every second)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            log.debug("dashboard: " + format, *args)

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Referrer-Policy", "no-referrer")
            if server.stopped.is_set():  # the job ended: no keep-alive connection stays open
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)

        def _json(self, status: int, value: Any) -> None:
            self._send(status, json.dumps(value, default=str).encode(), "application/json")

        def _route(self) -> tuple[str, dict] | None:
            parts = urlsplit(self.path)
            query = parse_qs(parts.query)
            if not server.allowed((query.get("token") or [None])[0], self.headers.get("Authorization")):
                self._send(403, b"forbidden: this dashboard needs its token (the URL the job logged, with ?token=...)\n",
                           "text/plain; charset=utf-8")
                return None
            return parts.path, query

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            routed = self._route()
            if routed is None:
                return
            path, query = routed
            try:
                if path in ("/", "/index.html"):
                    from .page import render_page

                    self._send(200, render_page(server.token).encode(), "text/html; charset=utf-8")
                elif path == "/api/job":
                    raw = (query.get("limit") or [str(DEFAULT_HISTORY)])[0]
                    limit = int(raw) if raw.isdigit() else DEFAULT_HISTORY
                    self._json(200, server.job(limit))
                elif path == "/metrics":
                    body, content_type = server.metrics()
                    self._send(200, body, content_type)
                else:
                    self._send(404, b"not found\n", "text/plain; charset=utf-8")
            except Exception as exc:  # noqa: BLE001 - a broken page must not kill the job
                log.warning(f"dashboard: {path}: {type(exc).__name__}: {exc}")
                self._send(500, f"{type(exc).__name__}: {exc}\n".encode(), "text/plain; charset=utf-8")

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(min(length, 65536))
            routed = self._route()
            if routed is None:
                return
            path, _query = routed
            if path in ("/api/checkpoint", "/api/savepoint"):
                self._json(*server.act(path.rsplit("/", 1)[1]))
            else:
                self._send(404, b"not found\n", "text/plain; charset=utf-8")

    return Handler
