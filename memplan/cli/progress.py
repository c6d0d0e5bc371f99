"""Progress bars on stderr for the commands that can run long: trace, profile, fit and compare.

A bar is drawn with rich on stderr, only when stderr is a terminal and only once the work has run past
``DELAY`` seconds: a quick run prints nothing more, and stdout (tables, ``--json``) is never touched.
``total=None`` draws a spinner with the elapsed time (work without steps to count, e.g. ``fit``'s
search). rich is imported when a bar is entered, never at start-up.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

DELAY = 1.0
"""Seconds of work before a bar appears (the issue's "when they run past a second")."""


class Bar:
    """``with Bar("tracing", total=n, unit="layer passes") as bar: … bar.advance(description=…)``."""

    def __init__(
        self,
        what: str,
        total: int | None = None,
        unit: str = "",
        *,
        enabled: bool = True,
        delay: float = DELAY,
        console: Console | None = None,
    ) -> None:
        self.what, self.total, self.unit = what, total, unit
        self.enabled, self.delay, self.console = enabled, delay, console
        self.on = False
        self.started = False
        self.lock = threading.Lock()

    def __enter__(self) -> Bar:
        if not self.enabled:
            return self
        from rich.console import Console

        console = self.console or Console(stderr=True)
        self.on = console.is_terminal
        if not self.on:
            return self
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        columns: list[Any] = [SpinnerColumn(), TextColumn(f"[bold]{self.what}[/bold] {{task.description}}")]
        if self.total is not None:
            columns += [BarColumn(), TextColumn(f"{{task.completed}}/{{task.total}} {self.unit}")]
        columns.append(TimeElapsedColumn())
        self.progress = Progress(*columns, console=console, transient=True)
        self.task = self.progress.add_task("", total=self.total)
        self.timer = threading.Timer(self.delay, self._start)
        self.timer.daemon = True
        self.timer.start()
        return self

    def _start(self) -> None:
        with self.lock:
            if self.on and not self.started:
                self.progress.start()
                self.started = True

    def advance(self, steps: int = 1, description: str | None = None) -> None:
        """``steps`` more done; ``description``: what runs now (``backward layer 3``)."""
        if self.on:
            self.progress.update(self.task, advance=steps, description=description)

    def __exit__(self, *exc: object) -> None:
        if not self.on:
            return
        self.timer.cancel()
        with self.lock:
            self.on = False
            if self.started:
                self.progress.stop()
