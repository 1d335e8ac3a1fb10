"""What the operator sees: each step with a progress bar (rich) and a one-line result."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn

from envex.bundles.files import one_line

STEPS = ("verify", "probe", "plan", "install", "gates", "activate")
PAUSE_MARKER = "ENVEX_TEST_PAUSED"


@dataclass
class StepHandle:
    progress: Progress | None
    task: TaskID | None

    def advance(self, amount: float = 1, description: str | None = None) -> None:
        if self.progress is not None and self.task is not None:
            if description is None:
                self.progress.update(self.task, advance=amount)
            else:
                self.progress.update(self.task, advance=amount, description=description)


@dataclass
class InstallUI:
    """Rich progress and result lines; `pause_at` is the test hook that stops the process before a step."""

    console: Console = field(default_factory=lambda: Console(highlight=False, soft_wrap=True))
    pause_at: str | None = None
    results: list[tuple[str, bool, str]] = field(default_factory=list)

    def pause_point(self, step: str) -> None:
        # Test hook (ENVEX_TEST_PAUSE_AT): announce, then stop ourselves; the test SIGKILLs or SIGCONTs us.
        if self.pause_at == step:
            print(f"{PAUSE_MARKER} {step}", flush=True)
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGSTOP)

    @contextmanager
    def step(self, name: str, total: float | None = None) -> Iterator[StepHandle]:
        self.pause_point(name)
        number = STEPS.index(name) + 1 if name in STEPS else 0
        label = f"[{number}/{len(STEPS)}] {name}"
        columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn()]
        with Progress(*columns, console=self.console, transient=True, disable=not self.console.is_terminal) as progress:
            task = progress.add_task(label, total=total)
            yield StepHandle(progress, task)

    def ok(self, name: str, message: str) -> None:
        self.results.append((name, True, message))
        self.console.print(f"[green]✓[/green] {name:<8} {escape(one_line(message))}", markup=True)

    def fail(self, name: str, message: str) -> None:
        self.results.append((name, False, message))
        self.console.print(f"[red]✗[/red] {name:<8} {escape(one_line(message))}", markup=True)

    def note(self, message: str) -> None:
        self.console.print(f"  {one_line(message)}", markup=False)
