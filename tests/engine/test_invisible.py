"""Nothing the library does is visible beyond the tower's output, for the life of a graph.

Each case runs the same program with the tower served by graphs and without, and
compares everything the program can see: the tower's outputs, the draws of the global
random generators after each call, and the tower's buffers at the end.
"""

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

from lightning_cg.adapters.batched import BatchedEncoderAdapter
from lightning_cg.engine.manager import EncoderGraphManager
from lightning_cg.engine.replay_checks import CHECK_SHARE, FIRST_PADDED_CHECKS, CheckSchedule


class Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 5)
        self.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class ScaledByColumnMax(Linear):
    """Rows interact only on some data: the zero padding rows win a column's max only
    when every real row of that column is negative."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x / x.max(0).values)


class CountsCalls(Linear):
    """A stateful tower: a step buffer that each call advances and adds to its output."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("step", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step += 1
        return self.linear(x) + self.step


def positive(rows: int) -> torch.Tensor:
    return torch.rand(rows, 6) + 0.5


def negative_column(rows: int) -> torch.Tensor:
    x = positive(rows)
    x[:, 2] = -x[:, 2]
    return x


#: (id, tower, batches, options, the warning the served run gives or None).
CASES = [
    (
        "coupling_shown_by_the_third_padded_batch",
        ScaledByColumnMax,
        [positive(3), positive(3), negative_column(3), positive(3)],
        {"budgets": {"budgets": [4]}, "capture": "first_use"},
        "rows likely interact",
    ),
    (
        "random_stream_after_each_call_under_first_use",
        Linear,
        [positive(3), positive(2), positive(4)],
        {"capture": "first_use"},
        None,
    ),
    (
        "random_stream_under_upfront",
        Linear,
        [positive(1), positive(3)],
        {"capture": "upfront"},
        None,
    ),
    (
        "stateful_tower_called_once_per_call",
        CountsCalls,
        [positive(3), positive(3), positive(2)],
        {"budgets": {"budgets": [4]}, "capture": "first_use"},
        "changes its buffers",
    ),
]


def program(call: Callable[[torch.Tensor], torch.Tensor], batches: list[torch.Tensor]) -> list:
    """A seeded user program: the tower's output, then draws of its own (from the CUDA
    generator too when the batches are there), per batch."""
    torch.manual_seed(1234)
    seen = []
    with torch.no_grad():
        for x in batches:
            seen += [call(x), torch.randn(3, device="cpu"), torch.randn(3, device=x.device)]
    return seen


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize(
    ("tower_class", "batches", "options", "warning"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_a_served_program_sees_what_an_eager_one_sees(
    tower_class, batches, options, warning, device
):
    torch.manual_seed(0)
    eager_tower = tower_class().to(device)
    served_tower = tower_class().to(device)
    served_tower.load_state_dict(eager_tower.state_dict())
    batches = [x.to(device) for x in batches]
    adapter = BatchedEncoderAdapter(served_tower)
    manager = EncoderGraphManager(adapter, **options)

    expected = program(eager_tower, batches)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        seen = program(lambda x: manager.execute(adapter.inputs_from_call((x,), {})), batches)

    for got, want in zip(seen, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name, buffer in eager_tower.named_buffers():
        torch.testing.assert_close(served_tower.get_buffer(name), buffer, rtol=0, atol=0)
    messages = [str(w.message) for w in warned]
    if warning is None:
        assert not [m for m in messages if "eagerly from now on" in m], messages
    else:
        assert len([m for m in messages if warning in m]) == 1, messages
    assert manager.stats.hits + manager.stats.misses > 0


def test_a_graph_is_checked_at_its_first_padded_replays_then_sampled_by_cost():
    schedule = CheckSchedule()
    padded = frozenset({"tokens"})
    for _ in range(FIRST_PADDED_CHECKS):
        assert schedule.due(padded)
        # A check costing four replays: the next comes once replays cost four / CHECK_SHARE.
        schedule.checked(padded, replay_seconds=0.001, check_seconds=0.004)
    spacing = round(4 / CHECK_SHARE)
    for _ in range(spacing - 1):
        assert not schedule.due(padded)
        schedule.replayed()
    assert schedule.due(padded)
    # A kind of padding not yet checked is checked at once; an unpadded replay once.
    assert schedule.due(frozenset({"tokens", "items"}))
    assert schedule.due(frozenset())
    schedule.checked(frozenset(), replay_seconds=0.001, check_seconds=0.004)
    assert not schedule.due(frozenset())


def test_a_sampled_check_catches_a_coupling_after_the_first_checks(monkeypatch):
    # A share so large that every replay after the first checks is sampled.
    monkeypatch.setattr("lightning_cg.engine.replay_checks.CHECK_SHARE", 1e9)
    tower = ScaledByColumnMax()
    adapter = BatchedEncoderAdapter(tower)
    manager = EncoderGraphManager(adapter, budgets={"budgets": [4]}, capture="first_use")
    batches = [positive(3) for _ in range(FIRST_PADDED_CHECKS + 2)] + [negative_column(3)]
    with torch.no_grad(), pytest.warns(UserWarning, match="rows likely interact"):
        outputs = [manager.execute(adapter.inputs_from_call((x,), {})) for x in batches]
    with torch.no_grad():
        torch.testing.assert_close(outputs[-1], tower(batches[-1]), rtol=1e-6, atol=1e-6)
    assert manager.stats.eager_replay_differs == 1
    assert manager.stats.checked_replays == len(batches)
