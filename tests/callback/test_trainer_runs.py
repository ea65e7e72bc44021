"""trainer_runs: a run's batch count from what Lightning gives (the validation runs a
fit still makes are checked through the callback, in test_callback_stages.py)."""

import pytest

from lightning_cg.callback.trainer_runs import total_batches


@pytest.mark.parametrize(
    ("batches", "expected"),
    [
        (12, 12),
        ([3, 4], 7),  # one count per dataloader
        ((5,), 5),
        (3.0, 3),  # a float count of a sized loader
        ([], None),
        (float("inf"), None),  # an iterable dataset of unknown length
        ([3, float("inf")], None),
        (None, None),
    ],
)
def test_total_batches_sums_the_dataloaders_or_is_unknown(batches, expected):
    assert total_batches(batches) == expected
