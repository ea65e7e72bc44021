"""graphed(tower, plan=...): what the capture rule learned is read on entering and
written on leaving, so a later block captures known keys at their first sighting."""

import json

import pytest
import torch
from torch import nn

from lightning_cg.serve.graphed import graphed

OPTIONS = dict(adapter="batched", budgets={"budgets": [4]})


def small_tower(width: int = 6, depth: int = 1) -> nn.Module:
    torch.manual_seed(0)
    layers = [module for _ in range(depth) for module in (nn.Linear(width, width), nn.GELU())]
    return nn.Sequential(*layers).eval()


def sightings(state: dict) -> list[int]:
    return sorted(record["sightings"] for record in state["keys"].values())


def test_graphed_reads_its_plan_on_entering_and_writes_it_on_leaving(tmp_path):
    tower = small_tower()
    plan = tmp_path / "plan.json"
    with torch.no_grad(), graphed(tower, plan=str(plan), **OPTIONS) as first:
        for _ in range(5):
            tower(torch.randn(4, 6))
        assert not plan.exists()
    state = json.loads(plan.read_text())
    assert state == first.manager.state_dict() and sightings(state) == [5]

    with torch.no_grad(), graphed(tower, plan=str(plan), **OPTIONS) as second:
        assert second.manager.state_dict() == state
        tower(torch.randn(4, 6))
    assert sightings(json.loads(plan.read_text())) == [6]

    with pytest.raises(KeyError), torch.no_grad(), graphed(tower, plan=str(plan), **OPTIONS):
        tower(torch.randn(4, 6))
        raise KeyError("the loop failed")
    assert sightings(json.loads(plan.read_text())) == [7]


@pytest.mark.cuda
def test_cuda_a_loaded_plan_captures_known_keys_at_first_sight_and_replays_equal_eager(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    # Launch-bound: a replay of 12 kernels beats running them one by one.
    tower = small_tower(width=64, depth=6).cuda()
    plan = tmp_path / "plan.json"
    # Items of 1, 2 and 3 rows of 64: three signatures, three keys of budget 4.
    rows = (1, 2, 3)
    with torch.inference_mode(), graphed(tower, plan=str(plan), **OPTIONS) as first:
        # Long enough that each key's eager time spent repays its measured capture cost.
        for _ in range(300):
            for count in rows:
                tower(torch.randn(4, count, 64, device="cuda"))
    assert first.stats["graphs"] == len(rows)
    state = json.loads(plan.read_text())
    assert sightings(state) == [300] * len(rows) and state["eager_keys"] == {}

    inputs = [torch.randn(4, count, 64, device="cuda") for count in (*rows, *rows)]
    with torch.inference_mode(), graphed(tower, plan=str(plan), **OPTIONS) as second:
        served = [tower(x) for x in inputs[: len(rows)]]
        # Each key was captured at its first sighting, its replay checked against eager.
        assert second.stats["eager_no_graph_yet"] == 0
        assert second.stats["graphs_captured"] == len(rows)
        assert second.stats["hits"] == len(rows)
        served += [tower(x) for x in inputs[len(rows) :]]
    assert second.stats["hits"] == len(inputs)
    with torch.inference_mode():
        for x, output in zip(inputs, served, strict=True):
            torch.testing.assert_close(output, tower(x), rtol=1e-5, atol=1e-5)
