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
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
    from rich.text import Text

    # rate and time left from what is done over the time since the bar started: rich's own
    # speed divides the last samples' progress by the time between those samples, and events
    # that arrive in a burst (a restore's, with the workers' heartbeats) made that a few
    # microseconds: 3,976 KiB read in 0.2 s showed as 63,601,195.3 KiB/s
    def average_speed(task: Any) -> float | None:
        elapsed = task.elapsed
        return task.completed / elapsed if elapsed and task.completed else None

    class RateColumn(ProgressColumn):
        def render(self, task: Any) -> Text:
            speed = average_speed(task)
            return Text("" if speed is None else f"{speed:,.1f} {task.fields.get('unit', '')}/s", style="progress.data.speed")

    class RemainingColumn(ProgressColumn):
        def render(self, task: Any) -> Text:
            speed = average_speed(task)
            if task.finished:
                left: float | None = 0.0
            elif speed is None or task.total is None:
                left = None
            else:
                left = max(0.0, task.total - task.completed) / speed
            if left is None:
                return Text("-:--:--", style="progress.remaining")
            minutes, seconds = divmod(int(left + 0.5), 60)
            hours, minutes = divmod(minutes, 60)
            return Text(f"{hours}:{minutes:02d}:{seconds:02d}", style="progress.remaining")

    console = Console(file=stream, force_terminal=True if force else None)
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[unit]}"),
               RateColumn(), TimeElapsedColumn(), TextColumn("eta"), RemainingColumn())
    with Progress(*columns, console=console, transient=False) as bars:
        ids: dict[str, Any] = {}

        def on_event(event: ProgressEvent) -> None:
            task = ids.get(event.stage)
            if task is None:
                task = ids[event.stage] = bars.add_task(event.stage, total=event.total, unit=event.unit)
            bars.update(task, completed=event.done, total=event.total)

        yield on_event
