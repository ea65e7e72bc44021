"""A rich progress bar for graph capture, shown on rank zero only."""

from __future__ import annotations

from lightning.fabric.utilities.rank_zero import rank_zero_only
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from lightning_cg.engine.encoder import CaptureSpec


class CaptureProgress:
    """A capture's progress bar for the manager, from its first graph to its last; shown
    only while ``enabled`` (the Trainer's own progress bar is on)."""

    def __init__(self) -> None:
        self.enabled = True
        self._progress: Progress | None = None
        self._task: int | None = None

    @rank_zero_only
    def __call__(self, done: int, total: int, spec: CaptureSpec) -> None:
        if not self.enabled:
            return
        if self._progress is None:
            self._progress = Progress(
                TextColumn("capturing CUDA graphs"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.description}"),
                TimeElapsedColumn(),
                transient=True,
            )
            self._progress.start()
            self._task = self._progress.add_task("", total=total)
        description = f"{spec.path} budget {spec.token_budget}"
        self._progress.update(self._task, completed=done, description=description)
        if done == total:
            self._progress.stop()
            self._progress = None
