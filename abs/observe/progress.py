"""Progress bars on a terminal for the events of long operations
(:class:`abscore.progress.ProgressEvent`), drawn by ``rich``: one bar per stage with done of
total, rate and time left. Nothing is drawn when the stream is not a terminal or the user
asked for quiet; the operation then runs without a callback."""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator, TextIO

from abscore.progress import ProgressCallback, ProgressEvent

__all__ = ["terminal_progress"]


def _wanted(stream: TextIO, quiet: bool) -> bool:
    if quiet:
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


@contextlib.contextmanager
def terminal_progress(*, quiet: bool = False, stream: TextIO | None = None,
                      force: bool = False) -> Iterator[ProgressCallback | None]:
    """Yields a progress callback that draws on ``stream`` (default: stderr), or ``None`` when
    ``stream`` is not a terminal or ``quiet`` is set (``force`` draws on any stream: tests)."""
    stream = stream if stream is not None else sys.stderr
    if not (force and not quiet) and not _wanted(stream, quiet):
        yield None
        return
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)
    from rich.text import Text

    class RateColumn(ProgressColumn):
        def render(self, task: Any) -> Text:
            speed = task.finished_speed or task.speed
            return Text("" if speed is None else f"{speed:,.1f} {task.fields.get('unit', '')}/s", style="progress.data.speed")

    console = Console(file=stream, force_terminal=True if force else None)
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[unit]}"),
               RateColumn(), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False) as bars:
        ids: dict[str, Any] = {}

        def on_event(event: ProgressEvent) -> None:
            task = ids.get(event.stage)
            if task is None:
                task = ids[event.stage] = bars.add_task(event.stage, total=event.total, unit=event.unit)
            bars.update(task, completed=event.done, total=event.total)

        yield on_event
