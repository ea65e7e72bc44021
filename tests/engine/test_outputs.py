"""CallOutputs: the rows of one call's sub-batches, split per item or joined per path."""

import torch

from lightning_cg.engine.outputs import CallOutputs


def rows_of(tokens: list[int], seed: int, width: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(sum(tokens), width, generator=generator)


def test_per_item_gives_each_items_rows_per_path_and_no_path_without_tokens():
    outputs = CallOutputs(4)
    # Sub-batch of items 2 and 0, then of items 3 and 1; item 1 has no global tokens.
    local_a, global_a = rows_of([2, 3], 0), rows_of([1, 1], 1)
    local_b, global_b = rows_of([4, 1], 2), rows_of([1, 0], 3)
    outputs.add("local", [2, 0], local_a, [2, 3])
    outputs.add("global", [2, 0], global_a, [1, 1])
    outputs.add("local", [3, 1], local_b, [4, 1])
    outputs.add("global", [3, 1], global_b, [1, 0])

    items = outputs.per_item()

    assert [sorted(item) for item in items] == [
        ["global", "local"],
        ["local"],
        ["global", "local"],
        ["global", "local"],
    ]
    torch.testing.assert_close(items[0]["local"], local_a[2:5])
    torch.testing.assert_close(items[1]["local"], local_b[4:5])
    torch.testing.assert_close(items[2]["local"], local_a[0:2])
    torch.testing.assert_close(items[3]["local"], local_b[0:4])
    torch.testing.assert_close(items[0]["global"], global_a[1:2])
    torch.testing.assert_close(items[2]["global"], global_a[0:1])
    torch.testing.assert_close(items[3]["global"], global_b[0:1])


def test_a_path_no_item_has_tokens_on_is_absent():
    outputs = CallOutputs(2)
    local = rows_of([2, 1], 0)
    outputs.add("local", [0, 1], local, [2, 1])
    outputs.add("global", [0, 1], local[:0], [0, 0])

    assert [list(item) for item in outputs.per_item()] == [["local"], ["local"]]
    assert list(outputs.joined()) == ["local"]


def test_one_block_of_every_item_in_order_is_joined_without_a_copy():
    outputs = CallOutputs(3)
    rows = rows_of([2, 1, 3], 0)
    outputs.add("local", [0, 1, 2], rows, [2, 1, 3])

    joined = outputs.joined()["local"]

    assert joined.data_ptr() == rows.data_ptr()
    torch.testing.assert_close(joined, rows)


def test_one_block_out_of_order_is_joined_in_item_order():
    outputs = CallOutputs(3)
    rows = rows_of([2, 1, 3], 0)  # items 2, 0, 1
    outputs.add("local", [2, 0, 1], rows, [2, 1, 3])

    joined = outputs.joined()["local"]

    torch.testing.assert_close(joined, torch.cat([rows[2:3], rows[3:6], rows[0:2]]))


def test_several_blocks_are_joined_in_item_order():
    outputs = CallOutputs(5)
    first, second, third = rows_of([1, 2], 0), rows_of([3], 1), rows_of([2, 4], 2)
    # Blocks of items (3, 1), (0), (4, 2): both out of order and interleaved.
    outputs.add("local", [3, 1], first, [1, 2])
    outputs.add("local", [0], second, [3])
    outputs.add("local", [4, 2], third, [2, 4])

    joined = outputs.joined()["local"]

    expected = torch.cat([second, first[1:3], third[2:6], first[0:1], third[0:2]])
    torch.testing.assert_close(joined, expected)
    assert joined.data_ptr() not in {block.data_ptr() for block in (first, second, third)}


def test_several_blocks_of_items_in_order_are_joined():
    outputs = CallOutputs(3)
    first, second = rows_of([2], 0), rows_of([1, 3], 1)
    outputs.add("local", [0], first, [2])
    outputs.add("local", [1, 2], second, [1, 3])

    torch.testing.assert_close(outputs.joined()["local"], torch.cat([first, second]))


def test_a_path_where_some_items_have_no_tokens_joins_the_others_in_order():
    outputs = CallOutputs(4)
    local = rows_of([2, 1, 3, 1], 0)
    outputs.add("local", [0, 1, 2, 3], local, [2, 1, 3, 1])
    # Items 1 and 3 have no global tokens; they came in two blocks, out of order.
    global_b, global_a = rows_of([2, 0], 1), rows_of([0, 3], 2)
    outputs.add("global", [2, 3], global_b, [2, 0])
    outputs.add("global", [1, 0], global_a, [0, 3])

    joined = outputs.joined()

    assert joined["local"].data_ptr() == local.data_ptr()
    torch.testing.assert_close(joined["global"], torch.cat([global_a, global_b]))
    assert "global" not in outputs.per_item()[1] and "global" not in outputs.per_item()[3]


def test_a_call_of_no_items_joins_to_none():
    outputs = CallOutputs(0)
    assert outputs.joined() is None
    assert outputs.per_item() == []
