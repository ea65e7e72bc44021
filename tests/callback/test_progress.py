"""The capture progress bar: shown while capturing, only with the Trainer's progress bar."""

from types import SimpleNamespace

import pytest

import lightning_cg.callback.progress as progress_module
from lightning_cg.callback.graph_callback import CUDAGraphCallback
from lightning_cg.callback.progress import CaptureProgress
from tests.callback.test_callback import BUDGETS, datamodule, model, trainer

SPEC = SimpleNamespace(path="image", token_budget=64)


class RecordingProgress:
    """Stands in for rich's Progress: counts the bars started and stopped."""

    started = stopped = 0

    def __init__(self, *columns, **options) -> None:
        pass

    def start(self) -> None:
        RecordingProgress.started += 1

    def add_task(self, description, total):
        return 0

    def update(self, task, **fields) -> None:
        pass

    def stop(self) -> None:
        RecordingProgress.stopped += 1


@pytest.fixture
def bars(monkeypatch):
    monkeypatch.setattr(progress_module, "Progress", RecordingProgress)
    RecordingProgress.started = RecordingProgress.stopped = 0
    return RecordingProgress


@pytest.mark.parametrize("enabled", [True, False])
def test_a_capture_shows_one_bar_from_first_graph_to_last_while_enabled(bars, enabled):
    progress = CaptureProgress()
    progress.enabled = enabled
    for done in (1, 2, 3):
        progress(done, 3, SPEC)
    assert (bars.started, bars.stopped) == ((1, 1) if enabled else (0, 0))


@pytest.mark.cuda
@pytest.mark.parametrize("bar", [True, False])
def test_the_capture_bar_follows_enable_progress_bar(bars, bar):
    callback = CUDAGraphCallback(budgets=BUDGETS, capture="first_use")
    trainer(callback, accelerator="gpu", devices=1, enable_progress_bar=bar).predict(
        model(), datamodule()
    )
    assert callback.last_stats["graphs_captured"] > 0
    assert (bars.started > 0) == bar
