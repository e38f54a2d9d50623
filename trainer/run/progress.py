"""Progress output: a rich progress bar on a terminal, plain log lines otherwise."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class Reporter:
    def __init__(self, interactive: bool | None = None):
        self.interactive = sys.stdout.isatty() if interactive is None else interactive
        self.console = Console(highlight=False)
        self._progress: Progress | None = None
        self._task: Any = None
        self._total = 0

    def log(self, message: str) -> None:
        if self.interactive:
            # As written: a line rich wrapped at the terminal's width would cut a secret in
            # it where the scrubbing of stdout (redaction.py) looks for it whole, and a
            # reward's error text is no markup.
            self.console.print(message, soft_wrap=True, markup=False)
        else:
            print(message, flush=True)

    def start(self, phase: str, total: int) -> None:
        self._total = total
        if self.interactive:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                console=self.console,
            )
            self._progress.start()
            self._task = self._progress.add_task(phase, total=total, info="")

    def advance(self, done: int, info: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=done, info=info)
        elif done == self._total or done % max(1, self._total // 20) == 0:
            print(f"  [{done}/{self._total}] {info}", flush=True)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
