import pytest
import torch

from examples.data.synthetic import (
    FakeDataModule,
    SyntheticDataModule,
    grid_sides,
    random_image_sizes,
    synthetic_images,
    synthetic_videos,
)


def test_sizes_are_seeded_multiples_in_range():
    sizes = random_image_sizes(50, seed=3, min_side=40, max_side=200, multiple=32)
    assert sizes == random_image_sizes(50, seed=3, min_side=40, max_side=200, multiple=32)
    assert sizes != random_image_sizes(50, seed=4, min_side=40, max_side=200, multiple=32)
    sides = {side for size in sizes for side in size}
    assert sides <= {64, 96, 128, 160, 192}
    assert len(sides) > 1


def test_images_and_videos_are_deterministic_and_varied():
    images = synthetic_images(6, seed=1, max_side=160, multiple=32)
    again = synthetic_images(6, seed=1, max_side=160, multiple=32)
    assert all(torch.equal(a, b) for a, b in zip(images, again, strict=True))
    assert all(x.dim() == 3 and x.shape[0] == 3 and x.shape[1] % 32 == 0 for x in images)
    assert len({tuple(x.shape) for x in images}) > 1
    videos = synthetic_videos(8, seed=1, max_side=96, multiple=32, min_frames=1, max_frames=3)
    assert all(x.dim() == 4 and x.shape[1] == 3 and 1 <= x.shape[0] <= 3 for x in videos)
    assert len({x.shape[0] for x in videos}) > 1


def test_bad_ranges_raise():
    with pytest.raises(ValueError, match="no multiple of 32"):
        grid_sides(40, 60, 32)
    with pytest.raises(ValueError, match="min_frames"):
        synthetic_videos(1, seed=0, min_frames=3, max_frames=2)
    with pytest.raises(ValueError, match="video_fraction"):
        SyntheticDataModule(video_fraction=1.5)


def batches(datamodule, split="predict"):
    datamodule.setup(split)
    return list(getattr(datamodule, f"{split}_dataloader")())


def test_packed_batches_match_their_grid():
    datamodule = SyntheticDataModule(
        num_items=6,
        batch_size=4,
        seed=2,
        min_side=8,
        max_side=32,
        patch_size=4,
        merge_size=2,
        video_fraction=0.5,
        num_classes=3,
    )
    loaded = batches(datamodule)
    assert [len(batch["targets"]) for batch in loaded] == [4, 2]
    for batch in loaded:
        grid = batch["grid_thw"]
        assert batch["pixel_patches"].shape == (grid.prod(-1).sum(), 3 * 4 * 4)
        assert (grid[:, 1:] % 2 == 0).all()
        assert batch["targets"].max() < 3
    assert (torch.cat([b["grid_thw"][:, 0] for b in loaded]) > 1).any()  # some videos


def test_packed_batches_are_deterministic_for_a_seed():
    def make(seed):
        return SyntheticDataModule(num_items=4, batch_size=4, seed=seed, max_side=64)

    first, second, other = (batches(make(seed))[0] for seed in (5, 5, 6))
    assert all(torch.equal(first[key], second[key]) for key in first)
    assert not torch.equal(first["pixel_patches"][:10], other["pixel_patches"][:10])


def test_fake_data_batches():
    datamodule = FakeDataModule(num_items=5, batch_size=2, image_size=32, num_classes=4, seed=1)
    loaded = batches(datamodule, "val")
    assert [batch["images"].shape for batch in loaded][0] == (2, 3, 32, 32)
    assert sum(len(batch["targets"]) for batch in loaded) == 5
    assert torch.equal(loaded[0]["images"], batches(datamodule, "val")[0]["images"])
