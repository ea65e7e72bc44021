"""Comparing a tower's structured outputs (ModelOutput, tuple, dict of tensors)."""

import torch
from torch.utils._pytree import tree_flatten


def assert_same_output(actual, expected, tolerance: float = 0.0) -> None:
    """Same type, same fields (None fields None) and nesting, tensors of the same
    shape and dtype, equal within ``tolerance``."""
    assert type(actual) is type(expected)
    actual_leaves, actual_spec = tree_flatten(actual)
    expected_leaves, expected_spec = tree_flatten(expected)
    assert actual_spec == expected_spec
    for got, want in zip(actual_leaves, expected_leaves, strict=True):
        if want is None:
            assert got is None
            continue
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
