"""The transformers towers of conf/model/: CLIP ViT-B/16 from a config, random weights."""

import pytest
import torch

pytest.importorskip("transformers")

from test_app import compose_config  # noqa: E402

from examples.models.hf import CLIP_VIT_B_16, HFVisionClassifier, clip_vision_tower  # noqa: E402
from lightning_cg.app.runner import run  # noqa: E402

TINY_CLIP = [
    "model=clip_vit_b16",
    "model.input.image_size=32",
    "+model.module.vision_tower.num_hidden_layers=1",
    "+model.module.vision_tower.hidden_size=32",
    "+model.module.vision_tower.intermediate_size=64",
    "+model.module.vision_tower.num_attention_heads=2",
]


def test_clip_config_is_vit_b16():
    cfg = compose_config("predict", ["model=clip_vit_b16"])
    tower = cfg.model.module.vision_tower
    assert tower._target_ == "examples.models.hf.clip_vision_tower"
    assert tower.image_size == 224 and cfg.model.input.patch_size == CLIP_VIT_B_16["patch_size"]
    assert CLIP_VIT_B_16 | {"image_size": 224} == {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "image_size": 224,
        "patch_size": 16,
        "projection_dim": 512,
    }


def test_predict_app_runs_clip_through_the_callback():
    cfg = compose_config(
        "predict",
        TINY_CLIP
        + [
            "data=fake",
            "data.num_items=6",
            "data.batch_size=3",
            "trainer=cpu",
            "compare_eager=true",
            "cudagraph.capture=first_use",
        ],
    )
    report = run(cfg, "predict")
    assert report.stats["items"] == 6 and report.stats["hits"] == 2
    assert report.max_abs_difference < 1e-5
    assert torch.cat(report.outputs).shape == (6, 32)


def test_classifier_embeds_with_the_pooled_output():
    torch.manual_seed(0)
    tower = clip_vision_tower(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
    ).eval()
    model = HFVisionClassifier(tower, num_classes=4)
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        embedded = model.predict_step({"images": images}, 0)
        torch.testing.assert_close(embedded, tower(pixel_values=images).pooler_output)
    with pytest.raises(ValueError, match="'images'"):
        model.embed({"pixel_patches": images})
