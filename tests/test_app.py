import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from lightning_cg.app import run

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
TINY_TOWER = [
    "+model.module.vision_tower.depth=1",
    "+model.module.vision_tower.hidden_size=32",
    "+model.module.vision_tower.num_heads=2",
    "+model.module.vision_tower.out_hidden_size=16",
]
TINY_VIT = [
    "model=vit_b_16",
    "+model.module.vision_tower.image_size=32",
    "+model.module.vision_tower.num_layers=1",
    "+model.module.vision_tower.hidden_dim=32",
    "+model.module.vision_tower.mlp_dim=64",
    "+model.module.vision_tower.num_heads=2",
    "model.input.image_size=32",
]
TINY_QWEN = [
    "model=qwen2_vl_vision",
    "model.module.vision_tower.config.depth=1",
    "model.module.vision_tower.config.embed_dim=32",
    "model.module.vision_tower.config.num_heads=2",
    "model.module.vision_tower.config.hidden_size=16",
    "model.module.vision_tower.config.patch_size=4",
]
SMALL_DATA = ["data=synthetic", "data.num_items=6", "data.max_side=64", "data.batch_size=3"]
GROUPS = {
    "cudagraph": ["full", "none", "piecewise", "full_and_piecewise", "full_uniform_only"],
    "cudagraph/budgets": ["pow2", "geometric", "explicit", "auto"],
    "model": ["packed_vit", "packed_vit_small", "vit_b_16", "resnet50", "qwen2_vl_vision"],
    "data": ["photos", "synthetic", "fake"],
    "trainer": ["default", "cpu", "gpu"],
}


def compose_config(name: str, overrides: list[str]):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose(name, overrides=overrides)


@pytest.mark.parametrize("name", ["predict", "validate", "train"])
@pytest.mark.parametrize(
    ("group", "option"), [(g, o) for g, options in GROUPS.items() for o in options]
)
def test_every_group_option_composes(name, group, option):
    cfg = OmegaConf.to_container(compose_config(name, [f"{group}={option}"]), resolve=True)
    assert cfg["cudagraph"]["_target_"] == "lightning_cg.CUDAGraphCallback"
    # Every interpolation (data <- the model's input sizes) resolved.
    assert (
        cfg["data"].get("patch_size", cfg["model"]["input"]["patch_size"])
        == cfg["model"]["input"]["patch_size"]
    )


@pytest.mark.parametrize("option", GROUPS["cudagraph"])
def test_every_mode_config_instantiates_a_callback(option):
    callback = instantiate(compose_config("predict", [f"cudagraph={option}"]).cudagraph)
    assert callback.mode.name.lower() == option


def test_predict_app_compares_with_eager():
    cfg = compose_config("predict", TINY_TOWER + SMALL_DATA + ["compare_eager=true", "trainer=cpu"])
    report = run(cfg, "predict")
    assert report.stats["items"] == 6 and report.stats["hits"] > 0
    assert report.max_abs_difference < 1e-4
    assert len(torch.cat(report.outputs)) == 6


def test_predict_app_on_the_qwen2_vl_tower_with_images_and_videos():
    """The data follows the tower's patch, merge and temporal patch sizes."""
    pytest.importorskip("transformers")
    videos = ["data.video_fraction=0.5", "data.max_frames=3"]
    cfg = compose_config(
        "predict", TINY_QWEN + SMALL_DATA + videos + ["compare_eager=true", "trainer=cpu"]
    )
    assert cfg.data.temporal_patch_size == 2 and cfg.data.patch_size == 4
    report = run(cfg, "predict")
    assert report.stats["items"] == 6 and report.stats["hits"] > 0
    assert report.max_abs_difference < 1e-5
    assert torch.cat(report.outputs).shape == (6, 16)


def test_validate_app_on_a_batch_first_tower():
    cfg = compose_config(
        "validate", TINY_VIT + ["data=fake", "data.num_items=8", "data.batch_size=4", "trainer=cpu"]
    )
    report = run(cfg, "validate")
    assert report.stats["items"] == 8 and report.stats["hit_rate"] == 1.0


@pytest.mark.parametrize("script", ["predict", "validate", "train"])
def test_each_script_runs_once(script):
    overrides = (
        TINY_TOWER
        + SMALL_DATA
        + [
            "trainer=cpu",
            "trainer.max_epochs=1",
            "hydra.run.dir=" + "${oc.env:TMPDIR,/tmp}/lcg-${now:%H%M%S%f}",
        ]
    )
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / f"{script}.py"), *overrides],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "hit rate" in result.stdout
