"""The result of a compatibility check: problems, each naming its object, and a verdict."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import IncompatibleSnapshotError

__all__ = ["Problem", "CompatibilityReport"]


@dataclass(frozen=True)
class Problem:
    """One finding. ``subject`` names the object (operator uid, ``uid/state``, file path,
    ``_job.json``, ``checkpoint 42``); ``message`` is a full sentence ending in an action."""

    kind: str
    subject: str
    message: str
    fatal: bool

    def __str__(self) -> str:
        return f"{'error' if self.fatal else 'warning'} [{self.kind}] {self.message}"


@dataclass(frozen=True)
class CompatibilityReport:
    """Result of :func:`check` / :func:`check_manifest`.

    ``fallback_checkpoint``: when the checkpoint's files are broken, the newest older
    checkpoint whose files verify (``None`` if none, or if files were fine / not verified).
    ``files_checked``: files verified, ``None`` when files were not verified.
    """

    checkpoint_id: int | None
    parallelism: int | None
    problems: tuple[Problem, ...]
    root: str | None = None
    fallback_checkpoint: int | None = None
    files_checked: int | None = None

    @property
    def fatal(self) -> tuple[Problem, ...]:
        return tuple(p for p in self.problems if p.fatal)

    @property
    def warnings(self) -> tuple[Problem, ...]:
        return tuple(p for p in self.problems if not p.fatal)

    @property
    def ok(self) -> bool:
        """True when nothing prevents the restore (warnings allowed)."""
        return not self.fatal

    @property
    def kinds(self) -> set[str]:
        return {p.kind for p in self.problems}

    def _what(self) -> str:
        what = f"checkpoint {self.checkpoint_id}" if self.checkpoint_id is not None else "the snapshot"
        return what + (f" of {self.root}" if self.root else "")

    def verdict(self, problems: str = "the problems above") -> str:
        """One line: can the snapshot be restored; if not, what to do (``problems``: how the
        list of problems is referred to, where it stands)."""
        at = f" at parallelism {self.parallelism}" if self.parallelism is not None else ""
        if self.ok:
            extra = f" ({len(self.warnings)} warning(s))" if self.warnings else ""
            files = "" if self.files_checked is None else f"; {self.files_checked} file(s) verified"
            return f"{self._what()} can be restored{at}{extra}{files}"
        if self.fallback_checkpoint is not None:
            action = f"restore from checkpoint {self.fallback_checkpoint} (its files verify), or fix {problems}"
        else:
            action = f"fix {problems}"
        return f"{self._what()} cannot be restored{at}: {len(self.fatal)} fatal problem(s); {action}"

    def lines(self) -> list[str]:
        return [str(p) for p in self.problems] + [self.verdict()]

    def raise_if_fatal(self) -> None:
        """Raise :class:`IncompatibleSnapshotError` (carrying this report) if anything is fatal."""
        if self.ok:
            return
        details = "; ".join(p.message for p in self.fatal)
        raise IncompatibleSnapshotError(f"{self.verdict('the problems named below')}: {details}", self)
