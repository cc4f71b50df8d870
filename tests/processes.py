"""The jobs a test runs: their worker processes (found in /proc, Linux), and waiting for a
running job to reach a state."""
from __future__ import annotations

import os
import subprocess
import time
from typing import Any, Callable


def parent_of(pid: int) -> int:
    """The parent pid of ``pid`` (from /proc; OSError when the process is gone)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[1])


def processes() -> dict[int, tuple[int, bytes]]:
    """Every process there is: pid -> (parent pid, command line as /proc has it, NUL-separated)."""
    out: dict[int, tuple[int, bytes]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            parent = parent_of(int(entry))
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                out[int(entry)] = (parent, f.read())
        except OSError:
            continue
    return out


def abs_workers() -> list[int]:
    """Pids of abs worker processes below this process (the Spark tasks' children)."""
    table = processes()
    parents = {pid: parent for pid, (parent, _) in table.items()}
    commands = {pid: cmd for pid, (_, cmd) in table.items()}

    def below_us(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == os.getpid():
                return True
        return False

    workers = {p for p, cmd in commands.items() if b"abs.runtime.worker_main" in cmd and below_us(p)}
    return sorted(p for p in workers if parents.get(p) not in workers)  # not their writer processes


def killed_process() -> subprocess.Popen:
    """A process killed by SIGKILL and reaped: what an executor's ``launch`` gives for a worker
    lost before it could connect to the driver."""
    proc = subprocess.Popen(["sleep", "60"])
    proc.kill()
    proc.wait()
    return proc


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
