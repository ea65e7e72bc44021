"""postprocess_joined of each adapter: the output built from each path's rows of every
item in order equals the one postprocess builds from the same rows per item, and the
tower's own forward."""

import random

import pytest
import torch
from output_checks import assert_same_output
from packed_calls import packed_call, packed_tower
from test_batched import tiny_vit

from lightning_cg.adapters.batched import BatchedEncoderAdapter
from lightning_cg.adapters.packed import PackedEncoderAdapter


def rows_per_path_and_item(adapter, inputs):
    """Each path's eager rows of every item in order, and the same rows per item
    (copies, so postprocess joins them rather than finding one tensor's views)."""
    specs = adapter.item_specs(inputs)
    path_rows: dict[str, torch.Tensor] = {}
    per_item: list[dict[str, torch.Tensor]] = [{} for _ in specs]
    for path in adapter.graph_config().paths:
        tokens = [spec.path_tokens.get(path, 0) for spec in specs]
        if not any(tokens):
            continue
        path_rows[path] = adapter.eager_forward(path, inputs)
        for item, rows, count in zip(per_item, path_rows[path].split(tokens), tokens, strict=True):
            if count:
                item[path] = rows.clone()
    return path_rows, per_item


def check_joined_equals_per_item_and_tower(adapter, inputs, expected) -> None:
    with torch.no_grad():
        path_rows, per_item = rows_per_path_and_item(adapter, inputs)
        joined = adapter.postprocess_joined(path_rows, inputs)
        per_item_output = adapter.postprocess(per_item, inputs)
    assert_same_output(joined, per_item_output)
    assert_same_output(joined, expected, tolerance=1e-5)


def test_batched_vit():
    torch.manual_seed(0)
    tower = tiny_vit()
    # torchvision zero-initialises the head: every image would give the same row.
    torch.nn.init.normal_(tower.heads.head.weight)
    x = torch.randn(5, 3, 16, 16)
    with torch.no_grad():
        expected = tower(x)
    assert not torch.allclose(expected[0], expected[1])
    adapter = BatchedEncoderAdapter(tower, max_batch_size=4)
    check_joined_equals_per_item_and_tower(adapter, adapter.inputs_from_call((x,), {}), expected)


@pytest.mark.parametrize("seed", [0, 1])
def test_packed_vit_with_a_global_view_interleaves_each_items_rows(seed):
    tower = packed_tower(global_view=True)
    patches, grid_thw = packed_call(random.Random(seed), 4, max_frames=2)
    with torch.no_grad():
        expected = tower(patches, grid_thw)
    adapter = PackedEncoderAdapter(tower)
    inputs = adapter.inputs_from_call((patches, grid_thw), {})
    assert len({spec.path_tokens["local"] for spec in adapter.item_specs(inputs)}) > 1
    check_joined_equals_per_item_and_tower(adapter, inputs, expected)


def test_packed_vit_without_a_global_view():
    tower = packed_tower()
    patches, grid_thw = packed_call(random.Random(2), 3)
    with torch.no_grad():
        expected = tower(patches, grid_thw)
    adapter = PackedEncoderAdapter(tower)
    inputs = adapter.inputs_from_call((patches, grid_thw), {})
    check_joined_equals_per_item_and_tower(adapter, inputs, expected)


@pytest.mark.parametrize(
    "options",
    [{}, {"output_hidden_states": True}, {"output_hidden_states": True, "return_dict": False}],
    ids=["plain", "hidden_states", "tuple"],
)
def test_hf_clip(options):
    pytest.importorskip("transformers")
    from test_hf import tiny_tower

    from lightning_cg.adapters.hf import HFEncoderAdapter

    tower = tiny_tower("clip")
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        expected = tower(pixel_values=x, **options)
    adapter = HFEncoderAdapter(tower)
    inputs = adapter.inputs_from_call((), {"pixel_values": x, **options})
    check_joined_equals_per_item_and_tower(adapter, inputs, expected)


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_qwen(kind):
    pytest.importorskip("transformers.models.qwen2_vl.modeling_qwen2_vl")
    from test_qwen import random_batch, tiny_tower

    from lightning_cg.adapters.qwen import QwenVisionAdapter

    tower = tiny_tower(kind)
    hidden_states, grid_thw = random_batch(seed=3, count=4)
    with torch.no_grad():
        expected = tower(hidden_states, grid_thw=grid_thw)
    adapter = QwenVisionAdapter(tower)
    inputs = adapter.inputs_from_call((hidden_states,), {"grid_thw": grid_thw})
    check_joined_equals_per_item_and_tower(adapter, inputs, expected)
