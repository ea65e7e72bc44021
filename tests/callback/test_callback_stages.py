"""When the callback swaps the tower's forward, seen from where the user's code runs:
inside the steps, in the sanity check, and in the ``on_*_end`` hooks after the callback's."""

import pytest
import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping
from test_callback import BUDGETS, RecordingModel, datamodule, trainer
from torch import nn

from lightning_cg.callback.graph_callback import CUDAGraphCallback
from lightning_cg.engine.manager import EncoderGraphManager


def runs_its_own_forward(tower: nn.Module) -> bool:
    """Whether calling ``tower`` runs its class's forward (nothing swapped in)."""
    return getattr(tower.forward, "__func__", None) is type(tower).forward


class ForwardSpy(RecordingModel):
    """Records, for each step and its own ``on_*_end``, whether the tower ran its own forward."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__()
        self.seen: list[tuple[str, bool]] = []

    def record(self, where: str) -> None:
        self.seen.append((where, runs_its_own_forward(self.vision_tower)))

    def validation_step(self, batch, batch_idx):
        self.record("sanity" if self.trainer.sanity_checking else "validate")
        return super().validation_step(batch, batch_idx)

    def test_step(self, batch, batch_idx):
        self.record("test")
        return super().test_step(batch, batch_idx)

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        self.record("predict")
        return super().predict_step(batch, batch_idx, dataloader_idx)

    def on_validation_end(self) -> None:
        self.record("on_validation_end")

    def on_test_end(self) -> None:
        self.record("on_test_end")

    def on_predict_end(self) -> None:
        self.record("on_predict_end")


class ForwardAtEnd(Callback):
    """A callback after the graph callback: records the tower's forward at each ``on_*_end``."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, bool]] = []

    def on_validation_end(self, trainer, pl_module) -> None:
        self.seen.append(("validate", runs_its_own_forward(pl_module.vision_tower)))

    def on_test_end(self, trainer, pl_module) -> None:
        self.seen.append(("test", runs_its_own_forward(pl_module.vision_tower)))

    def on_predict_end(self, trainer, pl_module) -> None:
        self.seen.append(("predict", runs_its_own_forward(pl_module.vision_tower)))


ALL_STAGES = ("validate", "test", "predict")


def run_every_stage(run, net) -> None:
    run.validate(net, datamodule(), verbose=False)
    run.test(net, datamodule(), verbose=False)
    run.predict(net, datamodule())


@pytest.mark.parametrize(
    "stages", [["predict"], ["validate"], ["test"], ["validate", "test", "predict"]]
)
def test_only_the_configured_stages_run_through_graphs(stages):
    net = ForwardSpy()
    callback = CUDAGraphCallback(budgets=BUDGETS, stages=stages, capture="first_use")
    run_every_stage(trainer(callback), net)
    steps = [(where, own) for where, own in net.seen if where in ALL_STAGES]
    # 12 items in batches of 4: three steps per stage, graphed only where configured.
    assert steps == [(stage, stage not in stages) for stage in ALL_STAGES for _ in range(3)]


def test_every_stage_runs_through_graphs_by_default():
    net = ForwardSpy()
    run_every_stage(trainer(CUDAGraphCallback(budgets=BUDGETS, capture="first_use")), net)
    assert [own for where, own in net.seen if where in ALL_STAGES] == [False] * 9


def test_a_test_run_matches_eager_and_reports_its_stats():
    callback = CUDAGraphCallback(budgets=BUDGETS, capture="first_use")
    net = ForwardSpy()
    graphed = trainer(callback).test(net, datamodule(), verbose=False)
    eager = trainer().test(net, datamodule(), verbose=False)
    assert graphed[0]["test_loss"] == pytest.approx(eager[0]["test_loss"], rel=1e-5)
    assert callback.last_stats["items"] == 12 and callback.last_stats["hits"] > 0


def test_the_sanity_check_runs_eagerly_and_validation_through_graphs():
    net = ForwardSpy()
    callback = CUDAGraphCallback(budgets=BUDGETS, capture="first_use")
    run = trainer(callback, num_sanity_val_steps=1, max_epochs=1, limit_val_batches=1)
    run.fit(net, datamodule())
    steps = [(where, own) for where, own in net.seen if where in ("sanity", "validate")]
    assert steps == [("sanity", True), ("validate", False)]


def test_the_original_forward_is_back_before_later_end_hooks_run():
    net = ForwardSpy()
    later = ForwardAtEnd()
    run_every_stage(trainer(CUDAGraphCallback(budgets=BUDGETS, capture="first_use"), later), net)
    assert later.seen == [(stage, True) for stage in ALL_STAGES]
    assert net.seen == [
        *[("validate", False)] * 3,
        ("on_validation_end", True),
        *[("test", False)] * 3,
        ("on_test_end", True),
        *[("predict", False)] * 3,
        ("on_predict_end", True),
    ]


def record_later_runs(monkeypatch) -> list[int | None]:
    """The ``later_runs`` every manager is given at each run's start, in order."""
    recorded: list[int | None] = []
    begin_run = EncoderGraphManager.begin_run

    def recording_begin_run(self, expected_calls=None, later_runs=None):
        recorded.append(later_runs)
        begin_run(self, expected_calls, later_runs)

    monkeypatch.setattr(EncoderGraphManager, "begin_run", recording_begin_run)
    return recorded


@pytest.mark.parametrize(
    "fit_options, expected",
    [
        ({"max_epochs": 3}, [2, 1, 0]),
        ({"max_epochs": 5, "check_val_every_n_epoch": 2}, [1, 0]),
        ({"max_epochs": 2, "max_steps": 6}, [None, None]),  # may end before its epochs
        ({"max_epochs": 1, "val_check_interval": 1}, [None] * 3),  # every training batch
        # Early stopping may end the fit after any validation run (not in these 3 epochs).
        ({"max_epochs": 3, "early_stopping": True}, [None] * 3),
    ],
)
def test_a_fit_tells_the_manager_how_many_validation_runs_follow(
    fit_options, expected, monkeypatch
):
    callback = CUDAGraphCallback(module="vision_tower", budgets=BUDGETS)
    later_runs = record_later_runs(monkeypatch)
    net = RecordingModel()
    data = datamodule()
    options = {name: value for name, value in fit_options.items() if name != "early_stopping"}
    stopping = [EarlyStopping("val_loss", patience=10)] if "early_stopping" in fit_options else []
    trainer(callback, *stopping, limit_val_batches=1, **options).fit(net, data)
    assert later_runs == expected
    trainer(callback).validate(net, data)
    trainer(callback).test(net, data, verbose=False)
    trainer(callback).predict(net, data)
    assert later_runs == [*expected, None, None, None]
