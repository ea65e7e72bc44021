"""Interrupted runs: an exception or Ctrl-C in a validation or predict step puts the
tower's forward back, and a later fit trains eagerly.

Lightning 2.6 turns a KeyboardInterrupt into ``on_exception`` on every callback,
then ``sys.exit(1)`` (and ignores SIGINT from then on, which the fixture undoes).
"""

import signal

import pytest
import torch
from test_callback import BUDGETS, RecordingModel, datamodule, trainer

from lightning_cg.callback.graph_callback import CUDAGraphCallback
from lightning_cg.engine.manager import EncoderGraphManager


class Interrupted(RecordingModel):
    """Raises ``error`` in the second step of ``stage``, after the tower ran through graphs."""

    def __init__(self, stage: str, error: BaseException) -> None:
        super().__init__()
        self.stage: str | None = stage
        self.error = error
        self.graphed_steps = 0

    def validation_step(self, batch, batch_idx):
        loss = super().validation_step(batch, batch_idx)
        self._step("validate", batch_idx)
        return loss

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        embeddings = super().predict_step(batch, batch_idx, dataloader_idx)
        self._step("predict", batch_idx)
        return embeddings

    def _step(self, stage: str, batch_idx: int) -> None:
        self.graphed_steps += "forward" in self.vision_tower.__dict__
        if stage == self.stage and batch_idx == 1:
            raise self.error


@pytest.fixture
def sigint_handler():
    """Put back the SIGINT handler Lightning replaces after a KeyboardInterrupt."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, handler)


def interrupt(run, stage: str, net, error: BaseException) -> None:
    expected = SystemExit if isinstance(error, KeyboardInterrupt) else type(error)
    with pytest.raises(expected) as raised:
        if stage == "validate":
            run.validate(net, datamodule(), verbose=False)
        else:
            run.predict(net, datamodule())
    if expected is SystemExit:
        assert raised.value.code == 1  # Lightning's graceful shutdown


def fit_trains_eagerly(callback: CUDAGraphCallback, net: RecordingModel) -> None:
    net.training_forwards.clear()
    trainer(callback, max_epochs=1).fit(net, datamodule())
    assert net.training_forwards and all(net.training_forwards)
    assert callback.last_stats["hits"] > 0  # the fit's validation used the graphs again


@pytest.mark.parametrize("stage", ["validate", "predict"])
@pytest.mark.parametrize(
    "error", [RuntimeError("boom"), KeyboardInterrupt()], ids=["error", "ctrl-c"]
)
def test_an_interrupted_step_restores_the_forward_and_fit_trains_eagerly(
    stage, error, sigint_handler
):
    torch.manual_seed(0)
    net = Interrupted(stage, error)
    callback = CUDAGraphCallback(budgets=BUDGETS, capture="first_use")
    interrupt(trainer(callback), stage, net, error)
    assert net.graphed_steps == 2  # both steps ran the graphed forward
    assert "forward" not in net.vision_tower.__dict__
    net.stage = None
    fit_trains_eagerly(callback, net)


@pytest.mark.parametrize(
    "error", [RuntimeError("boom"), KeyboardInterrupt()], ids=["error", "ctrl-c"]
)
def test_an_interrupt_inside_the_graphed_forward_unwinds_it(error, sigint_handler, monkeypatch):
    torch.manual_seed(0)
    net = Interrupted("none", error)
    callback = CUDAGraphCallback(budgets=BUDGETS, capture="first_use")
    execute = EncoderGraphManager.execute
    calls = []

    def interrupted_execute(manager, inputs):
        calls.append(torch.is_grad_enabled())
        if len(calls) == 2:
            raise error  # e.g. Ctrl-C while a replay fills its buffers
        return execute(manager, inputs)

    monkeypatch.setattr(EncoderGraphManager, "execute", interrupted_execute)
    interrupt(trainer(callback), "predict", net, error)
    monkeypatch.undo()
    assert len(calls) == 2 and "forward" not in net.vision_tower.__dict__
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    net.stage = None
    fit_trains_eagerly(callback, net)
    # The replays after the interruption equal eager.
    graphed = torch.cat(trainer(callback).predict(net, datamodule()))
    eager = torch.cat(trainer().predict(net, datamodule()))
    torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-6)
