import pytest
import torch
from lightning.pytorch import Trainer

from examples.data.synthetic import FakeDataModule, SyntheticDataModule
from examples.models.lit import (
    VisionClassifier,
    build_tower,
    embed_dim_of,
    pool_items,
    tower_names,
)

TINY_PACKED = {
    "hidden_size": 64,
    "depth": 2,
    "num_heads": 4,
    "patch_size": 4,
    "out_hidden_size": 32,
}
TINY_VIT = {
    "image_size": 32,
    "patch_size": 8,
    "num_layers": 1,
    "num_heads": 2,
    "hidden_dim": 32,
    "mlp_dim": 64,
    "num_classes": 16,
}


def trainer() -> Trainer:
    return Trainer(
        accelerator="cpu",
        fast_dev_run=True,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def packed_data(batch_size=3) -> SyntheticDataModule:
    return SyntheticDataModule(
        num_items=6,
        batch_size=batch_size,
        min_side=8,
        max_side=32,
        patch_size=4,
        video_fraction=0.3,
        num_classes=3,
    )


def run_all_stages(model, datamodule, batch_size):
    trainer().fit(model, datamodule=datamodule)
    (metrics,) = trainer().validate(model, datamodule=datamodule, verbose=False)
    assert "val_loss" in metrics
    predictions = trainer().predict(model, datamodule=datamodule)
    assert len(predictions) == 1
    assert predictions[0].shape == (batch_size, model.hparams.embed_dim)
    assert torch.isfinite(predictions[0]).all()


@pytest.mark.parametrize("global_view", [False, True])
def test_packed_tower_all_stages(global_view):
    tower = build_tower("packed_vit", **TINY_PACKED, global_view=global_view, global_grid=4)
    model = VisionClassifier(tower, num_classes=3)
    assert model.hparams.embed_dim == 32
    run_all_stages(model, packed_data(), batch_size=3)


def test_batch_first_vit_all_stages():
    model = VisionClassifier(build_tower("vit_b_16", **TINY_VIT), embed_dim=16, num_classes=4)
    datamodule = FakeDataModule(num_items=4, batch_size=2, image_size=32, num_classes=4)
    run_all_stages(model, datamodule, batch_size=2)


def test_resnet_predicts_one_row_per_image():
    model = VisionClassifier(build_tower("resnet18", num_classes=8)).eval()
    with torch.no_grad():
        embeddings = model.predict_step({"images": torch.randn(3, 3, 32, 32)}, 0)
    assert embeddings.shape == (3, 8)


def test_pool_items_means_each_items_rows():
    tokens = torch.arange(6.0).view(6, 1)
    torch.testing.assert_close(pool_items(tokens, [1, 2, 3]), torch.tensor([[0.0], [1.5], [4.0]]))
    with pytest.raises(ValueError, match="5 tokens"):
        pool_items(tokens, [2, 3])


def test_unknown_batch_and_tower_raise():
    model = VisionClassifier(build_tower("resnet18", num_classes=8))
    with pytest.raises(ValueError, match="pixel_patches"):
        model.embed({"pixels": torch.zeros(1)})
    with pytest.raises(ValueError, match="resnet50"):
        build_tower("resnet51")
    with pytest.raises(ValueError, match="embed_dim"):
        embed_dim_of(torch.nn.Identity())


def test_factories_and_embed_dims():
    assert set(tower_names()) >= {"packed_vit", "packed_vit_small", "vit_b_16", "resnet50"}
    small = build_tower(
        "packed_vit_small", depth=1, hidden_size=64, num_heads=4, out_hidden_size=48
    )
    assert (small.config.patch_size, embed_dim_of(small)) == (16, 48)
    assert embed_dim_of(build_tower("vit_b_16", **TINY_VIT)) == 16
    assert embed_dim_of(build_tower("resnet50")) == 1000
    with pytest.raises(TypeError):
        build_tower("packed_vit", no_such_field=1)


def test_vit_b_16_embeddings_are_not_all_zero():
    # torchvision zero-initialises the head; a zero embedding would make every
    # graph-against-eager comparison on this tower vacuous.
    tower = build_tower("vit_b_16", **TINY_VIT).eval()
    with torch.no_grad():
        embeddings = tower(torch.randn(2, 3, 32, 32))
    assert embeddings.abs().min() > 0
    assert not torch.allclose(embeddings[0], embeddings[1])
