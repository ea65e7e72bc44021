import pytest
import torch

from lightning_cg.adapters import join_rows


def shares_memory(first: torch.Tensor, second: torch.Tensor) -> bool:
    return first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()


def test_an_in_order_split_of_one_tensor_is_joined_without_a_copy():
    whole = torch.randn(10, 4)
    rows = list(whole.split([3, 5, 2]))
    joined = join_rows(rows)
    assert torch.equal(joined, whole) and shares_memory(joined, whole)
    assert joined.shape == (10, 4) and joined.is_contiguous()


@pytest.mark.parametrize(
    "pick",
    [
        lambda parts: [parts[1], parts[0], parts[2]],  # out of order
        lambda parts: parts[:2],  # not all of the tensor
        lambda parts: [parts[0], parts[0], parts[1], parts[2]],  # a part twice
        lambda parts: [parts[0], torch.randn(5, 4), parts[2]],  # another tensor
        lambda parts: [parts[0], parts[1][:0], parts[1], parts[2]],  # an empty part
    ],
)
def test_any_other_rows_are_copied_as_torch_cat_does(pick):
    whole = torch.randn(10, 4)
    rows = pick(list(whole.split([3, 5, 2])))
    joined = join_rows(rows)
    assert torch.equal(joined, torch.cat(rows))
    assert not shares_memory(joined, whole)


def test_strided_rows_are_copied():
    whole = torch.randn(4, 6)
    rows = [whole[:, :3], whole[:, 3:]]
    assert torch.equal(join_rows(rows), torch.cat(rows))
