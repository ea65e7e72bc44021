"""The capture rule's learning outlives the process: in every checkpoint, and in a plan
file read when the manager is built and written at each run's end. A plan of another
tower or device, or one that cannot be read, is ignored with one warning."""

import glob
import json

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from test_callback import trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_cg.callback.graph_callback import CUDAGraphCallback
from lightning_cg.core.capture_policy import (
    FIRST_CAPTURE_FACTOR,
    PRIOR_CAPTURE_RATIO,
    PRIOR_GRAPH_RATIO,
)

#: Validation batches of a run too short to repay a tower's first capture from its own
#: sightings: at a key's second sighting, each call left gains half an eager run.
VAL_BATCHES = int(PRIOR_CAPTURE_RATIO * FIRST_CAPTURE_FACTOR / (1 - PRIOR_GRAPH_RATIO))
#: A run one batch longer: its calls after the first repay the capture, so a key known
#: from a plan is captured at its first sighting; unknown, it waits for its second,
#: after which too few calls are left.
LATER_BATCHES = VAL_BATCHES + 1
BATCH = 4
OPTIONS = dict(module="tower", adapter="batched", budgets={"budgets": [BATCH]})


class Classifier(pl.LightningModule):
    """A small batch-first tower under a linear head."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tower = nn.Sequential(nn.Linear(width, 8), nn.GELU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 2)

    def loss(self, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.head(self.tower(x)), y)

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def loader(batches: int, width: int = 6) -> DataLoader:
    generator = torch.Generator().manual_seed(batches)
    x = torch.randn(batches * BATCH, width, generator=generator)
    y = torch.randint(0, 2, (batches * BATCH,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH)


def validate(callback: CUDAGraphCallback, width: int = 6, batches: int = VAL_BATCHES) -> dict:
    trainer(callback).validate(Classifier(width), loader(batches, width), verbose=False)
    return callback.last_stats


class StateAtStart(Callback):
    """What ``callback``'s manager holds when the validation run starts, before any batch."""

    def __init__(self, callback: CUDAGraphCallback) -> None:
        self.callback = callback
        self.state: dict | None = None

    def on_validation_start(self, trainer, pl_module):
        self.state = self.callback.manager.state_dict()


def test_a_checkpoint_restores_the_plan_and_known_keys_are_captured_at_first_sight(tmp_path):
    model = Classifier()
    first = CUDAGraphCallback(**OPTIONS)
    checkpoint = ModelCheckpoint(dirpath=tmp_path)
    fit = trainer(first, checkpoint, max_epochs=1, enable_checkpointing=True)
    fit.fit(model, loader(2), loader(VAL_BATCHES))
    assert first.last_stats["hits"] == 0  # one run alone does not repay a capture
    (path,) = glob.glob(str(tmp_path / "*.ckpt"))
    saved = torch.load(path, weights_only=False)["callbacks"][first.state_key]["manager"]
    assert saved == first.manager.state_dict()
    assert [record["sightings"] for record in saved["keys"].values()] == [VAL_BATCHES]

    second = CUDAGraphCallback(**OPTIONS)
    spy = StateAtStart(second)
    trainer(second, spy).validate(model, loader(LATER_BATCHES), ckpt_path=path, verbose=False)

    assert spy.state == saved
    stats = second.last_stats
    assert stats["eager_no_graph_yet"] == 0 and stats["hits"] >= 1
    assert stats["graphs"] == 0 and second.manager.is_captured()  # prepared, on the CPU
    # Without the checkpoint, the same run captures nothing.
    alone = CUDAGraphCallback(**OPTIONS)
    trainer(alone).validate(model, loader(LATER_BATCHES), verbose=False)
    assert alone.last_stats["eager_no_graph_yet"] == LATER_BATCHES


def test_a_plan_file_is_written_at_the_run_end_and_read_by_a_later_callback(tmp_path):
    plan = tmp_path / "plan.json"
    first = validate(CUDAGraphCallback(plan=str(plan), **OPTIONS))
    assert first["hits"] == 0 and first["eager_no_graph_yet"] == VAL_BATCHES
    state = json.loads(plan.read_text())
    assert [record["sightings"] for record in state["keys"].values()] == [VAL_BATCHES]

    later = CUDAGraphCallback(plan=str(plan), **OPTIONS)
    stats = validate(later, batches=LATER_BATCHES)
    assert stats["eager_no_graph_yet"] == 0 and stats["hits"] >= 1
    (record,) = json.loads(plan.read_text())["keys"].values()
    assert record["sightings"] == VAL_BATCHES + LATER_BATCHES
    assert validate(CUDAGraphCallback(**OPTIONS), batches=LATER_BATCHES)["hits"] == 0


def corrupt(plan, tmp_path):
    plan.write_text('{"format": 1, "calls": ')


def of_another_tower(plan, tmp_path):
    validate(CUDAGraphCallback(plan=str(plan), **OPTIONS), width=7)


def of_another_device(plan, tmp_path):
    validate(CUDAGraphCallback(plan=str(plan), **OPTIONS))
    state = json.loads(plan.read_text())
    state["fingerprint"]["device"] = "NVIDIA H100 80GB HBM3"
    plan.write_text(json.dumps(state))


@pytest.mark.parametrize(
    ("make_plan", "message"),
    [
        (corrupt, "it cannot be read"),
        (of_another_tower, "another parameter shapes and dtypes"),
        (of_another_device, "another device: 'NVIDIA H100 80GB HBM3' there, 'cpu' here"),
    ],
    ids=["corrupt", "other_tower", "other_device"],
)
def test_a_plan_that_does_not_fit_is_ignored_with_one_warning(tmp_path, make_plan, message):
    plan = tmp_path / "plan.json"
    make_plan(plan, tmp_path)
    callback = CUDAGraphCallback(plan=str(plan), **OPTIONS)
    with pytest.warns(RuntimeWarning) as warned:
        stats = validate(callback)

    messages = [str(w.message) for w in warned if "ignoring the plan" in str(w.message)]
    assert len(messages) == 1 and message in messages[0] and str(plan) in messages[0]
    # The run learned anew, and its plan replaced the one that did not fit.
    assert stats["eager_no_graph_yet"] == VAL_BATCHES
    state = json.loads(plan.read_text())
    assert state["fingerprint"]["device"] == "cpu"
    assert [record["sightings"] for record in state["keys"].values()] == [VAL_BATCHES]
