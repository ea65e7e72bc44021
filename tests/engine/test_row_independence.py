"""A graph serves a key only once its output on real rows matched eager.

Padding adds rows the tower never saw eagerly; a tower whose rows interact would
change its real rows' outputs, and a graph forward that reads a value fixed at capture
changes them in any replay. The engine compares a graph's first replay, its first
replays with each kind of padding, and sampled replays after them, with eager on the
same items, and sends a key that differs to eager for good (tests/engine/test_invisible.py
covers couplings that show only on some data).
"""

import warnings

import pytest
import torch
from torch import nn

from lightning_cg.adapters.batched import BatchedEncoderAdapter
from lightning_cg.engine.manager import EncoderGraphManager


class RowsInteract(nn.Module):
    """Rows that depend on the other rows of the batch."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(6, 5)
        self.how = how
        self.eval()  # a tower in train mode runs eagerly

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "batch_mean":
            return self.linear(x - x.mean(0))
        if self.how == "batch_size":
            return self.linear(x) * x.shape[0]
        return self.linear(x)  # independent rows


def serve(tower: nn.Module, *batches: torch.Tensor) -> tuple[EncoderGraphManager, list]:
    """The manager's outputs of ``batches``, with its default capture rule and checks."""
    adapter = BatchedEncoderAdapter(tower)
    manager = EncoderGraphManager(adapter, budgets={"budgets": [4, 8]}, capture="upfront")
    with torch.no_grad():
        return manager, [manager.execute(adapter.inputs_from_call((x,), {})) for x in batches]


def eager(tower: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return tower(x)


@pytest.mark.parametrize("how", ["batch_mean", "batch_size"])
def test_a_tower_whose_rows_interact_gets_eager_outputs_and_one_warning(how):
    tower = RowsInteract(how)
    batches = [torch.randn(3, 6), torch.randn(3, 6), torch.randn(4, 6)]
    with pytest.warns(UserWarning) as warned:
        manager, outputs = serve(tower, *batches)

    for x, out in zip(batches, outputs, strict=True):
        torch.testing.assert_close(out, eager(tower, x), rtol=0, atol=0)
    messages = [str(w.message) for w in warned if "rows likely interact" in str(w.message)]
    assert len(messages) == 1
    assert "RowsInteract: the graph of path 'image', budget 4" in messages[0]
    assert "This key runs eagerly from now on" in messages[0]
    # Every batch of budget 4 runs eagerly, the first one's replay replaced by eager:
    # nothing was served by a graph, so no graph-served tokens are counted either.
    stats = manager.stats
    assert (stats.eager_replay_differs, stats.misses, stats.hits) == (3, 3, 0)
    assert (stats.real_tokens, stats.padded_tokens) == (0, 0)
    assert (stats.host_seconds, stats.launch_seconds) == (0, 0)


def test_a_tower_of_independent_rows_is_checked_at_its_first_padded_replays_and_replays():
    tower = RowsInteract("independent")
    batches = [torch.randn(3, 6), torch.randn(3, 6), torch.randn(2, 6)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        manager, outputs = serve(tower, *batches)

    for x, out in zip(batches, outputs, strict=True):
        torch.testing.assert_close(out, eager(tower, x), rtol=1e-5, atol=1e-6)
    assert manager.stats.hits == 3 and manager.stats.eager_replay_differs == 0
    # One graph (budget 4), all three replays padded: each among the first checked.
    assert (manager.stats.checked_replays, manager.stats.checked_tokens) == (3, 8)


def test_a_full_batch_does_not_vouch_for_a_short_batchs_padding_rows():
    # The usual last batch: short, so padded up to the budget full batches filled.
    tower = RowsInteract("batch_mean")
    adapter = BatchedEncoderAdapter(tower)
    # The default ladder: a budget-4 graph has item slots to spare for a batch of 4.
    manager = EncoderGraphManager(adapter, capture="first_use")
    batches = [torch.randn(4, 6), torch.randn(4, 6), torch.randn(3, 6)]
    with torch.no_grad(), pytest.warns(UserWarning, match="rows likely interact"):
        outputs = [manager.execute(adapter.inputs_from_call((x,), {})) for x in batches]

    for x, out in zip(batches, outputs, strict=True):
        torch.testing.assert_close(out, eager(tower, x), rtol=1e-5, atol=1e-6)
    assert (manager.stats.hits, manager.stats.eager_replay_differs) == (2, 1)


class CountingAdapter(BatchedEncoderAdapter):
    """Counts the eager runs of the tower."""

    eager_runs = 0

    def eager_forward(self, path, inputs):
        CountingAdapter.eager_runs += 1
        return super().eager_forward(path, inputs)


def test_a_checked_replay_costs_one_eager_run():
    adapter = CountingAdapter(RowsInteract("independent"))
    manager = EncoderGraphManager(adapter, budgets={"budgets": [4, 8]}, capture="upfront")
    CountingAdapter.eager_runs = 0
    with torch.no_grad():
        for x in (torch.randn(3, 6), torch.randn(3, 6)):
            manager.execute(adapter.inputs_from_call((x,), {}))
    assert CountingAdapter.eager_runs == 2
    assert manager.stats.hits == 2
    assert (manager.stats.checked_replays, manager.stats.checked_tokens) == (2, 6)


class OffGraph(BatchedEncoderAdapter):
    """Its graph forward is off by one part in a thousand: above float32's tolerance."""

    def graph_forward(self, path, buffers):
        return super().graph_forward(path, buffers) * (1 + 1e-3)


def test_a_graph_that_differs_without_padding_is_caught_at_its_first_replay():
    tower = RowsInteract("independent")
    adapter = OffGraph(tower)
    # A batch of 4 fills the budget-4 graph: no padding rows, no empty item slots.
    manager = EncoderGraphManager(adapter, budgets={"budgets": [4]}, capture="upfront")
    x = torch.randn(4, 6)
    with torch.no_grad(), pytest.warns(UserWarning, match=r"1\.0+e-03\. Its graph forward"):
        out = manager.execute(adapter.inputs_from_call((x,), {}))
    torch.testing.assert_close(out, eager(tower, x), rtol=0, atol=0)
    assert (manager.stats.checked_replays, manager.stats.eager_replay_differs) == (1, 1)
