"""A call the graphs serve reaches the replay in at most five Python frames from the
patched forward: the host time of a replay is the frames it climbs through."""

import traceback

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader

from lightning_cg import CUDAGraphCallback

MAX_FRAMES = 5


class StackRecorder(nn.Module):
    """A batch-first tower that records the Python stack of each of its forwards."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.stacks: list[list[str]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.stacks.append([frame.name for frame in traceback.extract_stack()])
        return self.linear(x)


class Predictor(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.vision_tower = StackRecorder()

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.vision_tower(batch)


def predict(module: Predictor, accelerator: str) -> None:
    callback = CUDAGraphCallback(
        module="vision_tower", budgets={"budgets": [4]}, capture="upfront", adapter="batched"
    )
    trainer = Trainer(
        accelerator=accelerator,
        devices=1,
        callbacks=[callback],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.predict(module, DataLoader(torch.randn(12, 4), batch_size=3))
    assert callback.last_stats["hits"] >= 3


def frames_to(stack: list[str], last: str) -> list[str]:
    """The frames from the patched forward to the innermost ``last``."""
    start = stack.index("graphed_forward")
    end = len(stack) - 1 - stack[::-1].index(last)
    return stack[start : end + 1]


def test_a_replay_is_at_most_five_frames_below_the_patched_forward():
    module = Predictor()
    predict(module, "cpu")
    # Without CUDA a graph runs its forward eagerly on its buffers, from the replay.
    replays = [stack for stack in module.vision_tower.stacks if "replay" in stack]
    assert replays
    path = frames_to(replays[-1], "replay")
    assert len(path) <= MAX_FRAMES, path


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_replay_is_called_at_most_five_frames_below_the_patched_forward(monkeypatch):
    stacks: list[list[str]] = []
    replay = torch.cuda.CUDAGraph.replay

    def recorded_replay(graph: torch.cuda.CUDAGraph) -> None:
        stacks.append([frame.name for frame in traceback.extract_stack()[:-1]])
        replay(graph)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", recorded_replay)
    predict(Predictor(), "gpu")
    served = [stack for stack in stacks if "graphed_forward" in stack]
    assert served
    path = frames_to(served[-1], served[-1][-1])
    assert len(path) <= MAX_FRAMES, path
