import socket

import pytest
import torch

from examples.data.photos import (
    PhotosDataModule,
    fit_to_grid,
    load_photo,
    load_photos,
    photo_names,
)


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("photos must load without network access")

    monkeypatch.setattr(socket.socket, "connect", refuse)


def test_every_photo_loads_offline_as_rgb(no_network):
    names = photo_names()
    assert len(names) >= 8
    for name in names:
        photo = load_photo(name)
        assert photo.dim() == 3 and photo.shape[0] == 3 and photo.dtype == torch.float32
        assert 0.0 <= photo.min() and photo.max() <= 1.0
    assert load_photo("astronaut").shape == (3, 512, 512)


def test_unknown_photo_names_the_allowed_ones():
    with pytest.raises(ValueError, match="astronaut"):
        load_photo("lena")


def test_fit_to_grid_caps_rounds_and_keeps_aspect():
    image = torch.rand(3, 427, 640)  # rocket
    native = fit_to_grid(image, 32)
    assert native.shape == (3, 416, 640)
    capped = fit_to_grid(image, 32, max_side=300)
    assert capped.shape[1] % 32 == 0 and capped.shape[2] % 32 == 0
    assert max(capped.shape[1:]) <= 300
    assert capped.shape[2] / capped.shape[1] == pytest.approx(640 / 427, rel=0.2)
    assert fit_to_grid(torch.rand(3, 20, 500), 32, max_side=256).shape == (3, 32, 256)
    with pytest.raises(ValueError, match="max_side"):
        fit_to_grid(image, 32, max_side=16)


def test_photos_are_normalized_grid_multiples(no_network):
    for photo in load_photos(multiple=32, max_side=200):
        assert photo.shape[1] % 32 == 0 and photo.shape[2] % 32 == 0
        assert max(photo.shape[1:]) <= 200
        assert photo.min() < 0  # ImageNet normalization moved the range


def test_packed_batches_match_their_grid(no_network):
    datamodule = PhotosDataModule(batch_size=4, max_side=128, patch_size=8, merge_size=2)
    datamodule.setup("predict")
    loaded = list(datamodule.predict_dataloader())
    assert sum(len(batch["targets"]) for batch in loaded) == len(photo_names())
    for batch in loaded:
        grid = batch["grid_thw"]
        assert batch["pixel_patches"].shape == (grid.prod(-1).sum(), 3 * 8 * 8)
        assert (grid[:, 0] == 1).all() and (grid[:, 1:] % 2 == 0).all()
    datamodule.setup("validate")
    assert torch.equal(next(iter(datamodule.val_dataloader()))["grid_thw"], loaded[0]["grid_thw"])


def test_fixed_size_batches_for_batch_first_towers(no_network):
    datamodule = PhotosDataModule(batch_size=3, fixed_size=64, num_classes=4)
    datamodule.setup("predict")
    batch = next(iter(datamodule.predict_dataloader()))
    assert batch["images"].shape == (3, 3, 64, 64)
    assert batch["targets"].tolist() == [0, 1, 2]


def test_bad_datamodule_arguments_raise():
    with pytest.raises(ValueError, match="max_side"):
        PhotosDataModule(max_side=16, patch_size=16, merge_size=2)
    with pytest.raises(ValueError, match="fixed_size"):
        PhotosDataModule(fixed_size=0)
