"""The jobs a test runs: their worker processes (found in /proc, Linux), and waiting for a
running job to reach a state."""
from __future__ import annotations

import os
import time
from typing import Any, Callable


def abs_workers() -> list[int]:
    """Pids of abs worker processes below this process (the Spark tasks' children)."""
    parents: dict[int, int] = {}
    commands: dict[int, bytes] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                parents[int(entry)] = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                commands[int(entry)] = f.read()
        except OSError:
            continue

    def below_us(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == os.getpid():
                return True
        return False

    workers = {p for p, cmd in commands.items() if b"abs.runtime.worker_main" in cmd and below_us(p)}
    return sorted(p for p in workers if parents.get(p) not in workers)  # not their writer processes


def wait_while_running(what: str, ready: Callable[[], Any], handle: Any, timeout: float = 180.0) -> None:
    """Poll ``ready()`` until it holds; fail at once, with the job's result, if the job of
    ``handle`` ended first (the timeout only bounds a hang)."""
    deadline = time.monotonic() + timeout
    while not ready():
        if handle.metrics()["status"] in ("FAILED", "CANCELED", "FINISHED"):
            raise AssertionError(f"{what}: the job ended first: {handle.wait(timeout=10)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.05)
