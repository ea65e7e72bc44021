import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf
from rich.console import Console

from lightning_cg.app.runner import PassReport, RunReport, print_report, run

ROOT = Path(__file__).resolve().parents[2]
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
    "cudagraph": ["full", "none", "full_uniform_only"],
    "cudagraph/budgets": ["pow2", "geometric", "explicit"],
    "model": ["packed_vit", "packed_vit_small", "vit_b_16", "resnet50", "qwen2_vl_vision"],
    "data": ["photos", "synthetic", "fake"],
    "trainer": ["default", "cpu", "gpu"],
}


def compose_config(name: str, overrides: list[str]):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose(name, overrides=overrides)


@pytest.mark.parametrize("name", ["predict", "validate", "test", "train"])
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


@pytest.mark.parametrize(
    ("override", "path", "expected"),
    [
        # the form conf/cudagraph/full.yaml documents, and the + form
        ("cudagraph.paths={global:{budgets:[64,256]}}", "global", {"budgets": (64, 256)}),
        ("cudagraph.paths={local:{max_budget:32}}", "local", {"max_budget": 32}),
        ("+cudagraph.paths.local.max_budget=32", "local", {"max_budget": 32}),
    ],
)
def test_paths_overrides_reach_the_callback(override, path, expected):
    callback = instantiate(compose_config("predict", [override]).cudagraph)
    choice = callback.config.paths[path]
    assert {key: getattr(choice, key) for key in expected} == expected


def printed(report: RunReport) -> str:
    console = Console(record=True, width=200)
    print_report(report, console=console)
    return console.export_text()


def test_predict_app_compares_with_eager():
    overrides = ["compare_eager=true", "trainer=cpu", "cudagraph.capture=first_use"]
    cfg = compose_config("predict", TINY_TOWER + SMALL_DATA + overrides)
    report = run(cfg, "predict")
    assert report.stats["items"] == 6 and report.stats["hits"] > 0
    assert report.max_abs_difference < 1e-4
    assert len(torch.cat(report.outputs)) == 6


def test_passes_time_the_tower_of_each_run_with_and_without_the_callback():
    overrides = ["compare_eager=true", "trainer=cpu", "passes=3"]
    report = run(compose_config("predict", TINY_TOWER + SMALL_DATA + overrides), "predict")
    assert len(report.passes) == len(report.eager_passes) == 3
    assert len(torch.cat(report.outputs)) == 3 * 6 and report.max_abs_difference < 1e-4
    for times in report.passes + report.eager_passes:
        assert 0 < times.tower_seconds < times.wall_seconds
    assert report.seconds == pytest.approx(sum(times.wall_seconds for times in report.passes))
    assert all(times.stats["items"] == 6 for times in report.passes)
    rows = [line.split() for line in printed(report).splitlines()]
    assert [row[1] for row in rows if len(row) == 9 and row[-2].endswith("x")] == ["1", "2", "3"]


def test_passes_default_to_one_on_a_cpu_without_eager():
    report = run(compose_config("predict", TINY_TOWER + SMALL_DATA + ["trainer=cpu"]), "predict")
    assert len(report.passes) == 1 and report.eager_passes is None


@pytest.mark.parametrize("passes", [0, -1])  # passes=many: tests/app/test_bad_config_table.py
def test_bad_passes_name_the_field(passes):
    cfg = compose_config("predict", TINY_TOWER + SMALL_DATA + ["trainer=cpu", f"passes={passes}"])
    with pytest.raises(ValueError, match="passes must be a positive integer"):
        run(cfg, "predict")


def cpu_pass(tower_seconds: float) -> PassReport:
    stats = {"items": 4, "tokens": 64, "sub_batches": 2, "hits": 2, "misses": 0, "graphs": 0}
    return PassReport(tower_seconds, tower_seconds + 0.1, {**stats, "capture_seconds": 0.3})


def test_the_cpu_report_does_not_speak_of_graphs():
    passes = [cpu_pass(0.5), cpu_pass(0.4)]
    report = RunReport("predict", 1.1, passes[-1].stats, device="cpu", passes=passes)
    text = printed(report)
    assert "ran its CPU path" in text and "nothing captured or replayed" in text
    for graph_words in ("graph replays", "hit rate", "graphs captured", "capture:"):
        assert graph_words not in text


def test_the_gpu_report_shows_passes_against_eager_and_capture_per_run():
    def gpu_pass(tower_seconds: float, graphs: int, capture: float) -> PassReport:
        stats = {**cpu_pass(0).stats, "graphs_captured": graphs, "capture_seconds_run": capture}
        return PassReport(tower_seconds, tower_seconds + 0.1, stats)

    passes = [gpu_pass(0.9, 7, 0.5), gpu_pass(0.2, 0, 0.0), gpu_pass(0.2, 2, 0.25)]
    eager = [PassReport(0.4, 0.5), PassReport(0.4, 0.5), PassReport(0.4, 0.5)]
    report = RunReport(
        "predict", 1.6, passes[-1].stats, device="cuda:0", passes=passes, eager_passes=eager
    )
    report.eager_seconds, report.max_abs_difference = 1.5, 0.0
    lines = printed(report).splitlines()
    pass_rows = [line.split()[1::2] for line in lines if line.endswith("x │")]
    assert pass_rows == [
        ["1", "0.400", "0.900", "0.44x"],
        ["2", "0.400", "0.200", "2.00x"],
        ["3", "0.400", "0.200", "2.00x"],
    ]
    capture = [line for line in lines if line.startswith("capture:")]
    assert capture == [
        "capture: 9 graphs in 0.75 s (graphs per pass: 7, 0, 2); the tower seconds above include it"
    ]


def test_predict_app_on_the_qwen2_vl_tower_with_images_and_videos():
    """The data follows the tower's patch, merge and temporal patch sizes."""
    pytest.importorskip("transformers")
    videos = ["data.video_fraction=0.5", "data.max_frames=3"]
    cfg = compose_config(
        "predict",
        TINY_QWEN
        + SMALL_DATA
        + videos
        + ["compare_eager=true", "trainer=cpu"]
        + ["cudagraph.capture=first_use"],
    )
    assert cfg.data.temporal_patch_size == 2 and cfg.data.patch_size == 4
    report = run(cfg, "predict")
    assert report.stats["items"] == 6 and report.stats["hits"] > 0
    assert report.max_abs_difference < 1e-5
    assert torch.cat(report.outputs).shape == (6, 16)


def test_validate_app_on_a_batch_first_tower():
    cfg = compose_config(
        "validate",
        TINY_VIT
        + ["data=fake", "data.num_items=8", "data.batch_size=4", "trainer=cpu"]
        + ["cudagraph.capture=first_use"],
    )
    report = run(cfg, "validate")
    assert report.stats["items"] == 8 and report.stats["hit_rate"] == 1.0


def test_test_app_runs_trainer_test_through_graphs_and_against_eager():
    cfg = compose_config(
        "test",
        TINY_VIT
        + ["data=fake", "data.num_items=8", "data.batch_size=4", "trainer=cpu"]
        + ["cudagraph.capture=first_use", "compare_eager=true"],
    )
    report = run(cfg, "test")
    assert report.stage == "test" and report.stats["items"] == 8
    assert report.stats["hit_rate"] == 1.0
    # One pass each way: the test loss of the graphed pass against the eager one.
    assert [list(output) for output in report.outputs] == [["test_loss"]]
    assert report.max_abs_difference < 1e-5


@pytest.mark.parametrize("script", ["predict", "validate", "test", "train"])
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
    assert "padding waste" in result.stdout
    assert "graph replays" not in result.stdout + result.stderr


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("cudagraph.stages=[validate]", "cudagraph.stages=['validate'] leaves out 'predict'"),
        ("cudagraph.module=backbone", "cudagraph.module='backbone': module='backbone' does"),
        ("cudagraph.budgets.max_budget=100000000000000", "max_budget=100000000000000 cannot fit"),
    ],
)
def test_a_refused_config_exits_with_its_message_and_no_traceback(override, named):
    # Refused before any work: a bad config of the tiny tower fails in seconds.
    overrides = [*TINY_TOWER, *SMALL_DATA, "trainer=cpu", override, "hydra.run.dir=/tmp/lcg-bad"]
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "predict.py"), *overrides],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 1
    assert result.stderr.startswith("error: ") and named in result.stderr
    assert "Traceback" not in result.stderr and "File " not in result.stderr


def test_many_passes_show_the_first_two_then_the_mean():
    passes = [PassReport(1.0, 1.1), PassReport(0.7, 0.8)] + [PassReport(0.5, 0.6)] * 10
    eager = [PassReport(0.5, 0.6)] * 12
    report = RunReport("predict", 8.0, {}, device="cpu", passes=passes, eager_passes=eager)
    lines = printed(report).splitlines()
    pass_rows = [line.split("│")[1:-1] for line in lines if line.endswith("x │")]
    assert [[cell.strip() for cell in row] for row in pass_rows] == [
        ["1", "0.500", "1.000", "0.50x"],
        ["2", "0.500", "0.700", "0.71x"],
        ["3-12, mean", "0.500", "0.500", "1.00x"],
    ]


@pytest.mark.cuda
def test_the_gpu_demo_runs_passes_against_eager():
    report = run(compose_config("predict", TINY_TOWER + SMALL_DATA + ["trainer=gpu"]), "predict")
    assert len(report.passes) == len(report.eager_passes) == 5
    assert all(times.tower_seconds > 0 for times in report.passes + report.eager_passes)
    assert report.max_abs_difference < 0.1  # bf16
    text = printed(report)
    assert "vs eager" in text and "capture:" in text and "CPU path" not in text
