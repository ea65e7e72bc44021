"""The replay check: a checked replay within its dtype's tolerance serves, one past it runs
eagerly; an eager output that is not finite judges no graph, so the next replay is checked."""

import warnings

import pytest
import torch
from torch import nn

from lightning_cg.adapters.batched import BatchedEncoderAdapter
from lightning_cg.engine.manager import EncoderGraphManager
from lightning_cg.engine.replay import relative_error
from lightning_cg.engine.replay_checks import FIRST_PADDED_CHECKS

#: The check's relative tolerance per output dtype: docs/DESIGN.md's, and float32's for a
#: dtype it names none for. Read here, not from the library, so that a changed tolerance
#: fails these tests.
DOCUMENTED_TOLERANCE = {
    torch.float32: 1e-4,
    torch.bfloat16: 2e-2,
    torch.float16: 1e-2,
    torch.float64: 1e-4,
}


def linear_tower(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(6, 5).to(dtype).eval()


class OffBy(BatchedEncoderAdapter):
    """Its graph forward's rows are eager's scaled by ``1 + error``."""

    def __init__(self, tower: nn.Module, error: float) -> None:
        super().__init__(tower)
        self.error = error

    def graph_forward(self, path, buffers):
        return off_by(super().graph_forward(path, buffers), self.error)


def off_by(rows: torch.Tensor, error: float) -> torch.Tensor:
    return (rows.double() * (1 + error)).to(rows.dtype)


def serve(adapter: BatchedEncoderAdapter, *batches: torch.Tensor):
    """The manager and its outputs of ``batches``: graphs of budgets 4 and 8, captured
    at their first call, each first replay checked."""
    manager = EncoderGraphManager(adapter, budgets={"budgets": [4, 8]}, capture="upfront")
    with torch.no_grad():
        return manager, [manager.execute(adapter.inputs_from_call((x,), {})) for x in batches]


# --------------------------------------------------------------- tolerance


@pytest.mark.parametrize("dtype", DOCUMENTED_TOLERANCE, ids=str)
@pytest.mark.parametrize("share", [0.9, 1.1], ids=["just-below", "just-above"])
def test_a_replay_serves_just_below_its_dtypes_tolerance_and_not_just_above(dtype, share):
    tolerance = DOCUMENTED_TOLERANCE[dtype]
    tower = linear_tower(dtype)
    x = torch.randn(4, 6).to(dtype)  # fills the budget-4 graph: no padding
    with torch.no_grad():
        eager = tower(x)
    injected = off_by(eager, share * tolerance)
    # What the graph gives is that far from eager, rounding to the dtype included.
    assert relative_error(injected, eager) == pytest.approx(share * tolerance, rel=0.02)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager, [out] = serve(OffBy(tower, share * tolerance), x)
    differs = [w for w in caught if "differs from eager" in str(w.message)]
    stats = manager.stats
    assert stats.checked_replays == 1
    if share < 1:
        torch.testing.assert_close(out, injected, rtol=0, atol=0)  # the replay serves
        assert (stats.hits, stats.eager_replay_differs, len(differs)) == (1, 0, 0)
    else:
        torch.testing.assert_close(out, eager, rtol=0, atol=0)  # eager serves instead
        assert (stats.hits, stats.eager_replay_differs, len(differs)) == (0, 1, 1)


# ------------------------------------------------------ non-finite eager


def with_bad_row(x: torch.Tensor, value: float) -> torch.Tensor:
    x = x.clone()
    x[1, 2] = value
    return x


class NaNRow(BatchedEncoderAdapter):
    """Its graph forward's first row is NaN: non-finite where eager is finite."""

    def graph_forward(self, path, buffers):
        rows = super().graph_forward(path, buffers).clone()
        rows[0] = float("nan")
        return rows


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_an_eager_output_with_non_finite_rows_judges_the_graph_on_its_finite_entries(value):
    tower = linear_tower()
    adapter = OffBy(tower, 1e-2)
    bad = with_bad_row(torch.randn(3, 6), value)
    with pytest.warns(UserWarning, match="differs from eager"):
        manager, [out] = serve(adapter, bad)
    with torch.no_grad():
        torch.testing.assert_close(out, tower(bad), rtol=0, atol=0, equal_nan=True)
    assert (manager.stats.checked_replays, manager.stats.eager_replay_differs) == (1, 1)


def test_a_replay_that_is_not_finite_where_eager_is_differs():
    tower = linear_tower()
    x = torch.randn(3, 6)
    with pytest.warns(UserWarning, match="differs from eager"):
        manager, [out] = serve(NaNRow(tower), x)
    with torch.no_grad():
        torch.testing.assert_close(out, tower(x), rtol=0, atol=0)
    assert manager.stats.eager_replay_differs == 1


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_an_eager_output_with_no_finite_entry_judges_no_graph_and_the_checks_go_on(value):
    tower = linear_tower()
    clean = [torch.randn(3, 6) for _ in range(FIRST_PADDED_CHECKS + 1)]
    batches = [torch.full((3, 6), value), *clean]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        manager, outputs = serve(BatchedEncoderAdapter(tower), *batches)

    with torch.no_grad():
        for x, out in zip(batches, outputs, strict=True):
            torch.testing.assert_close(out, tower(x), rtol=1e-5, atol=1e-6, equal_nan=True)
    # The budget-4 graph served every batch; the first counted as no check, so the first
    # checks went on through the clean batches after it, and the last replayed alone.
    stats = manager.stats
    assert (stats.hits, stats.eager_replay_differs) == (len(batches), 0)
    assert stats.checked_replays == 1 + FIRST_PADDED_CHECKS


def test_a_replay_of_another_shape_than_eager_differs():
    # A tower whose rows are a batch x batch product: the padded graph's are wider.
    class Gram(nn.Module):
        def forward(self, x):
            return x @ x.T

    with pytest.warns(UserWarning, match="differs from eager"):
        manager, [out] = serve(BatchedEncoderAdapter(Gram().eval()), torch.randn(3, 6))
    assert manager.stats.eager_replay_differs == 1


def test_complex_outputs_are_compared_in_both_parts():
    class ScaledImaginary(nn.Module):
        def forward(self, x):
            return torch.complex(x, x * x.shape[0])

    with pytest.warns(UserWarning, match="differs from eager"):
        manager, [out] = serve(BatchedEncoderAdapter(ScaledImaginary().eval()), torch.randn(3, 6))
    assert manager.stats.eager_replay_differs == 1
