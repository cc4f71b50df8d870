"""Processes of the jobs a test runs, found in /proc (Linux)."""
from __future__ import annotations

import os


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
