import numpy as np
import pytest
import torch
from torchvision.models.vision_transformer import VisionTransformer

from examples.models.packed_vit import (
    PackedViT,
    PackedViTConfig,
    block_diagonal_mask,
    packed_vit_config,
    packed_vit_small_config,
    patchify,
    tokens_per_item,
)

PATCH = 4


def tiny_config(**overrides) -> PackedViTConfig:
    sizes = dict(hidden_size=64, depth=2, num_heads=4, patch_size=PATCH, out_hidden_size=32)
    return PackedViTConfig(**{**sizes, "mlp_ratio": 2.0, "global_grid": 4, **overrides})


def tiny_tower(**overrides) -> PackedViT:
    torch.manual_seed(0)
    return PackedViT(tiny_config(**overrides)).eval()


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm()).item()


def test_tokens_per_item_counts_merged_and_global_tokens():
    grid_thw = torch.tensor([[1, 4, 6], [2, 2, 2]])
    assert tokens_per_item(grid_thw, tiny_config()) == [6, 2]
    assert tokens_per_item(grid_thw, tiny_config(global_view=True)) == [10, 6]
    assert tokens_per_item([(1, 8, 8)], tiny_config(global_view=True, global_grid=8)) == [32]


@pytest.mark.parametrize("global_view", [False, True])
def test_forward_shape_for_images_and_videos(global_view):
    tower = tiny_tower(global_view=global_view)
    items = [torch.randn(3, 16, 24), torch.randn(2, 3, 8, 8), torch.randn(3, 32, 8)]
    patches, grid_thw = patchify(items, PATCH)
    with torch.no_grad():
        out = tower(patches, grid_thw)
    assert out.shape == (sum(tokens_per_item(grid_thw, tower.config)), 32)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("global_view", [False, True])
def test_forward_of_an_empty_batch(global_view):
    tower = tiny_tower(global_view=global_view)
    with torch.no_grad():
        out = tower(torch.empty(0, 3 * PATCH**2), torch.empty(0, 3, dtype=torch.long))
    assert out.shape == (0, 32)


def test_forward_joins_local_then_global_rows_per_item():
    tower = tiny_tower(global_view=True)
    patches, grid_thw = patchify([torch.randn(3, 16, 16), torch.randn(3, 8, 24)], PATCH)
    with torch.no_grad():
        out = tower(patches, grid_thw)
        local = tower.encode_local(patches, grid_thw).split([4, 3])
        views = tower.encode_global(patches, grid_thw).split(4)
    expected = torch.cat([local[0], views[0], local[1], views[1]])
    torch.testing.assert_close(out, expected)


def test_attention_stays_within_each_item():
    tower = tiny_tower(global_view=True)
    items = [torch.randn(3, 16, 16), torch.randn(2, 3, 8, 16), torch.randn(3, 8, 8)]
    changed = [items[0], items[1] + 1.0, items[2]]
    with torch.no_grad():
        before = tower(*patchify(items, PATCH)).split([8, 8, 5])
        after = tower(*patchify(changed, PATCH)).split([8, 8, 5])
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(after[2], before[2], rtol=0, atol=1e-6)
    assert not torch.allclose(after[1], before[1])


def test_attention_stays_within_each_frame():
    tower = tiny_tower()
    video = torch.randn(2, 3, 16, 16)
    edited = torch.stack([video[0], video[1] * 2.0])
    with torch.no_grad():
        before = tower(*patchify([video], PATCH)).split(4)
        after = tower(*patchify([edited], PATCH)).split(4)
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=1e-6)
    assert not torch.allclose(after[1], before[1])


def test_block_diagonal_mask_gives_padding_rows_their_own_block():
    cu_seqlens = torch.tensor([0, 2, 5, 5], dtype=torch.int32)  # last sequence empty
    sequence_ids = torch.tensor([0, 0, 1, 1, 1, 9, 9])  # rows 5 and 6 are padding
    expected = sequence_ids[:, None] == sequence_ids[None, :]
    assert torch.equal(block_diagonal_mask(cu_seqlens, 7), expected)


def test_padding_rows_leave_real_rows_unchanged_and_stay_finite():
    tower = tiny_tower()
    patches, grid_thw = patchify([torch.randn(3, 16, 8), torch.randn(2, 3, 8, 8)], PATCH)
    metadata = tower.build_metadata(grid_thw, patches.device)
    pad = 12  # patches, three merge windows
    padded = {
        "pixel_patches": torch.cat([patches, torch.zeros(pad, patches.shape[1])]),
        "cu_seqlens": torch.cat([metadata["cu_seqlens"], metadata["cu_seqlens"][-1:].repeat(2)]),
        "positions": torch.cat([metadata["positions"], torch.zeros(pad, 2, dtype=torch.int32)]),
    }
    with torch.no_grad():
        exact = tower.forward_packed(patches, **metadata, max_seqlen=8)
        out = tower.forward_packed(**padded, max_seqlen=patches.shape[0] + pad)
    assert out.shape == (exact.shape[0] + 3, 32)
    assert torch.isfinite(out).all()
    assert relative_error(out[: exact.shape[0]], exact) < 1e-5


def test_host_metadata_has_one_sequence_per_frame_and_window_ordered_positions():
    tower = tiny_tower()
    metadata = tower.host_metadata([(1, 4, 6), (2, 2, 2)])
    assert metadata["cu_seqlens"].dtype == metadata["positions"].dtype == torch.int32
    assert metadata["cu_seqlens"].tolist() == [0, 24, 28, 32]
    assert metadata["positions"].shape == (32, 2)
    # Rows go merge window after window: (0,0) (0,1) (1,0) (1,1), then (0,2) ...
    assert metadata["positions"][:5].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [0, 2]]
    # Each frame of the video starts again at (0, 0).
    assert metadata["positions"][24].tolist() == metadata["positions"][28].tolist() == [0, 0]


@pytest.mark.parametrize("grid", [[(1, 4, 6), (2, 2, 2)], [(3, 6, 2)], [(1, 2, 2)], []])
def test_host_metadata_pieces_stack_to_host_metadata(grid):
    tower = tiny_tower()
    pieces = tower.host_metadata_pieces(grid)
    for name, tensor in tower.host_metadata(grid).items():
        assert np.array_equal(np.concatenate(pieces[name]), tensor.numpy()), name
        assert all(piece.dtype == np.int32 for piece in pieces[name])


def test_host_metadata_does_not_share_memory_between_calls():
    tower = tiny_tower()
    first = tower.host_metadata([(1, 2, 2)])["positions"]
    first.zero_()  # frame positions are cached per size; callers get copies
    assert tower.host_metadata([(1, 2, 2)])["positions"].tolist() == [
        [0, 0],
        [0, 1],
        [1, 0],
        [1, 1],
    ]


def test_global_view_resizes_the_first_frame():
    tower = tiny_tower(global_view=True)  # global view: 4 x 4 patches of 4 px
    same_size = torch.randn(2, 3, 16, 16)
    patches, grid_thw = patchify([same_size, torch.randn(3, 32, 8)], PATCH)
    views, view_grid = tower.global_view_patches(patches, grid_thw)
    assert view_grid.tolist() == [[1, 4, 4], [1, 4, 4]]
    assert views.shape == (32, 3 * PATCH * PATCH)
    # A first frame already at the view's size passes through unchanged.
    torch.testing.assert_close(views[:16], patches[:16])


def tiny_torchvision_vit(**overrides) -> VisionTransformer:
    torch.manual_seed(1)
    sizes = dict(image_size=32, patch_size=4, num_layers=2, num_heads=4, hidden_dim=64)
    return VisionTransformer(**{**sizes, "mlp_dim": 128, **overrides}).eval()


def test_load_torchvision_vit_reproduces_its_encoder():
    tower, vit = tiny_tower(), tiny_torchvision_vit()
    tower.load_torchvision_vit(vit)
    image = torch.randn(3, 16, 24)
    patches, _ = patchify([image], PATCH)
    rows = patches.shape[0]
    with torch.no_grad():
        # Positions all zero make the rotary embedding the identity.
        out = tower.forward_packed(
            patches,
            cu_seqlens=torch.tensor([0, rows], dtype=torch.int32),
            positions=torch.zeros(rows, 2, dtype=torch.int32),
            max_seqlen=rows,
        )
        tokens, _ = patchify([vit.conv_proj(image[None])[0]], patch_size=1)  # (T, D)
        encoded = vit.encoder.ln(vit.encoder.layers(tokens[None]))[0]
        expected = tower.merger.mlp(encoded.reshape(-1, 4 * 64))
    assert relative_error(out, expected) < 1e-5


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"hidden_dim": 32, "mlp_dim": 64}, "hidden_dim=32"), ({"num_layers": 3}, "num_layers=3")],
)
def test_load_torchvision_vit_rejects_other_sizes(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_tower().load_torchvision_vit(tiny_torchvision_vit(**overrides))


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"num_heads": 3}, "hidden_size"),
        ({"global_grid": 3}, "global_grid"),
        ({"depth": 0}, "depth"),
    ],
)
def test_config_errors_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=f"PackedViTConfig.{field}"):
        tiny_config(**overrides)


def test_presets():
    small = packed_vit_small_config(global_view=True)
    assert (small.hidden_size, small.depth, small.num_heads, small.patch_size) == (768, 12, 12, 16)
    assert small.mlp_hidden_size == 3072 and small.global_view
    large = packed_vit_config()
    assert (large.hidden_size, large.depth, large.patch_size, large.head_dim) == (1280, 32, 14, 80)


@pytest.mark.cuda
def test_cuda_forward_compiles_and_matches_eager():
    # The metadata's pinned host copy must step aside while dynamo traces.
    torch._dynamo.reset()
    tower = tiny_tower(global_view=True).cuda()
    items = [torch.randn(3, 16, 24), torch.randn(3, 32, 8)]
    patches, grid_thw = patchify(items, PATCH)
    patches = patches.cuda()
    compiled = torch.compile(tower, backend="aot_eager")
    with torch.no_grad():
        assert relative_error(compiled(patches, grid_thw), tower(patches, grid_thw)) < 1e-5
    torch._dynamo.reset()


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
def test_forward_compiles_and_matches_eager(grad_mode):
    # Lightning predicts under inference mode, where dynamo's guards on the host
    # metadata's numpy arrays failed: the host metadata must stay out of the trace.
    torch._dynamo.reset()
    tower = tiny_tower(global_view=True)
    compiled = torch.compile(tower, backend="aot_eager")
    for sizes in [((3, 16, 24), (3, 32, 8)), ((3, 8, 8),)]:
        patches, grid_thw = patchify([torch.randn(size) for size in sizes], PATCH)
        with grad_mode():
            assert relative_error(compiled(patches, grid_thw), tower(patches, grid_thw)) < 1e-5
    torch._dynamo.reset()
