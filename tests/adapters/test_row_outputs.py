"""TokenLayout: a Qwen tower's output fields side by side in one row per token, and back;
a field without a row per token or per patch is refused by name."""

import re

import pytest
import torch

from lightning_cg.adapters.row_outputs import TokenLayout

TOKENS, MERGE_AREA = 3, 4
PATCHES = TOKENS * MERGE_AREA


def test_fields_of_a_row_per_token_or_per_patch_go_to_rows_and_back():
    output = {
        "last_hidden_state": torch.randn(TOKENS, 5),
        "hidden_states": (torch.randn(PATCHES, 2), torch.randn(PATCHES, 2)),
    }
    layout = TokenLayout.of(output, TOKENS, MERGE_AREA)
    rows = layout.to_rows(output, TOKENS)
    assert rows.shape == (TOKENS, layout.width) == (TOKENS, 5 + 2 * MERGE_AREA * 2)
    back = layout.from_rows(rows)
    torch.testing.assert_close(back["last_hidden_state"], output["last_hidden_state"])
    assert isinstance(back["hidden_states"], tuple)
    for rebuilt, original in zip(back["hidden_states"], output["hidden_states"], strict=True):
        torch.testing.assert_close(rebuilt, original)


@pytest.mark.parametrize(
    ("value", "what"),
    [
        ((torch.zeros(TOKENS, 2), torch.zeros(TOKENS, 4)), "tensors of shapes [(3, 2), (3, 4)]"),
        ((torch.zeros(TOKENS, 2), torch.zeros(PATCHES, 2)), "tensors of shapes [(3, 2), (12, 2)]"),
        (torch.zeros(TOKENS + 2, 2), "tensors of shapes [(5, 2)]"),
        (torch.zeros(TOKENS), "tensors of shapes [(3,)]"),
        ((), "a tuple"),
        ({"inner": torch.zeros(TOKENS, 2)}, "a dict"),
        ("text", "a str"),
    ],
    ids=["widths-differ", "rows-differ", "rows-neither", "one-dim", "empty", "dict", "str"],
)
def test_a_field_without_a_row_per_token_or_per_patch_is_refused_by_name(value, what):
    output = {"last_hidden_state": torch.zeros(TOKENS, 5), "extra": value}
    message = f"output field 'extra' holds {what}, not 2-D tensors"
    with pytest.raises(ValueError, match=re.escape(message)):
        TokenLayout.of(output, TOKENS, MERGE_AREA)
