"""Verification of checkpoints: manifests parse, chains are well formed, every referenced file
exists with the recorded size and checksum (with the algorithm its manifest names).

The structural checks are pure (:func:`structural_problems`); :func:`check_files` does the I/O.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Literal, Mapping

from .format import checksum_hex
from .ids import CheckpointId
from .manifest import FileRef, Manifest, manifest_problems

__all__ = ["Problem", "ProblemKind", "VerifyReport", "structural_problems", "check_files"]

ProblemKind = Literal["manifest", "chain", "missing", "size", "checksum", "unreadable"]


@dataclass(frozen=True)
class Problem:
    """One thing wrong, naming the checkpoints it breaks and the file (if any)."""

    kind: ProblemKind
    checkpoints: tuple[CheckpointId, ...]
    path: str | None
    message: str

    def __str__(self) -> str:
        ids = ", ".join(str(c) for c in self.checkpoints)
        where = f"checkpoint{'s' if len(self.checkpoints) > 1 else ''} {ids}"
        return f"{where}: {self.path + ': ' if self.path else ''}{self.message}"


@dataclass(frozen=True)
class VerifyReport:
    """Result of :meth:`SnapshotStore.verify`."""

    checkpoints: tuple[CheckpointId, ...]
    files_checked: int
    bytes_checked: int
    problems: tuple[Problem, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def broken(self) -> tuple[CheckpointId, ...]:
        """Checkpoints affected by at least one problem."""
        return tuple(sorted({c for p in self.problems for c in p.checkpoints}))

    @property
    def latest_intact(self) -> CheckpointId | None:
        """Newest checked checkpoint without problems (what to restore from)."""
        bad = set(self.broken)
        intact = [c for c in self.checkpoints if c not in bad]
        return max(intact) if intact else None

    def lines(self) -> list[str]:
        out = [str(p) for p in self.problems]
        verdict = "OK" if self.ok else f"{len(self.problems)} problem(s) in checkpoints {list(self.broken)}"
        action = ""
        if not self.ok:
            action = (f"; restore from checkpoint {self.latest_intact}" if self.latest_intact is not None
                      else "; no checked checkpoint is intact")
        out.append(
            f"verified {len(self.checkpoints)} checkpoint(s), {self.files_checked} file(s), "
            f"{self.bytes_checked} bytes: {verdict}{action}"
        )
        return out


def structural_problems(manifests: Mapping[int, Manifest], unreadable: Mapping[int, str]) -> list[Problem]:
    """Problems visible without reading data files (pure)."""
    problems = [
        Problem("manifest", (CheckpointId(cid),), None, f"manifest unreadable: {reason}")
        for cid, reason in sorted(unreadable.items())
    ]
    for cid, manifest in sorted(manifests.items()):
        for path, message in manifest_problems(manifest):
            problems.append(Problem("chain", (CheckpointId(cid),), path, message))
    return problems


def check_files(
    manifests: Mapping[int, Manifest],
    listing: Mapping[str, int],
    read: Callable[[str], bytes],
    *,
    workers: int = 8,
) -> tuple[list[Problem], int, int]:
    """Check existence, size and checksum of every distinct referenced file.

    Returns (problems, files checked, bytes read). ``read`` fetches a file by relative path.
    """
    users: dict[str, list[CheckpointId]] = {}
    refs: dict[str, FileRef] = {}
    for cid, manifest in sorted(manifests.items()):
        for path, ref in manifest.files().items():
            users.setdefault(path, []).append(CheckpointId(cid))
            refs.setdefault(path, ref)

    def check(path: str) -> tuple[Problem | None, int]:
        ref = refs[path]
        who = tuple(users[path])
        if path not in listing:
            return Problem("missing", who, path, f"file (written by checkpoint {ref.checkpoint_id}) is missing"), 0
        if listing[path] != ref.bytes:
            return Problem("size", who, path, f"size {listing[path]} bytes, the manifest says {ref.bytes}: torn or altered write"), 0
        try:
            data = read(path)
        except FileNotFoundError:
            return Problem("missing", who, path, f"file (written by checkpoint {ref.checkpoint_id}) vanished while verifying"), 0
        except OSError as exc:
            return Problem("unreadable", who, path, f"cannot be read: {exc}"), 0
        if len(data) != ref.bytes:
            return Problem("size", who, path, f"read {len(data)} bytes, the manifest says {ref.bytes}: torn or altered write"), len(data)
        digest = checksum_hex(data, ref.checksum_algorithm)
        if digest != ref.checksum:
            return Problem("checksum", who, path, f"{ref.checksum_algorithm} {digest[:12]}..., the manifest says "
                           f"{ref.checksum[:12]}...: corrupt file"), len(data)
        return None, len(data)

    paths = sorted(refs)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        results = list(pool.map(check, paths))
    problems = [p for p, _ in results if p is not None]
    return problems, len(paths), sum(n for _, n in results)
