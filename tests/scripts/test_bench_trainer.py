"""scripts/bench_trainer.py on the CPU: tiny towers, two-batch runs, the row schema."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the top-level bench package, however pytest was started

import bench.trainer.suite  # noqa: E402
from bench.trainer.rows import ROW_KEYS, merge_rows, speedup_bars  # noqa: E402
from bench.trainer.runs import TrainerSettings, predict_runs, validate_runs  # noqa: E402
from bench.trainer.workloads import (  # noqa: E402
    MULTISCALE_BATCHES,
    PREDICT_BATCHES,
    TINY_SIZES,
    SyntheticBatches,
    Workload,
    make_tower,
)

CPU = TrainerSettings("cpu", "32-true")
#: A multiscale workload small enough for the CPU: two images a batch, one batch per side.
TINY_MULTISCALE = ("--workloads=multiscale/resnet50/batch_2", "--batches=4")


def load_script():
    """scripts/bench_trainer.py as a module, to run its main() in this process."""
    spec = importlib.util.spec_from_file_location(
        "bench_trainer_script", ROOT / "scripts" / "bench_trainer.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench_trainer_here(tmp_path: Path, *args: str) -> list[dict]:
    """main() of scripts/bench_trainer.py in this process: tiny towers on the CPU,
    eager and the callback; the rows it wrote."""
    output = tmp_path / "trainer.json"
    argv = ["--device=cpu", "--tiny", "--methods", "eager", "callback", f"--output={output}"]
    load_script().main([*argv, *args])
    return json.loads(output.read_text())


def bench_trainer(*args: str, device: str = "cpu") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_trainer.py"), f"--device={device}", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def test_smoke_run_writes_one_row_per_workload_length_and_run(tmp_path):
    output = tmp_path / "trainer.json"
    result = bench_trainer(
        "--tiny",
        "--batches=2",
        "--workloads",
        "vit_b_16/batch_1",
        "packed_vit_small/mixed_batch_8",
        "fit/packed_vit_small/mixed_batch_8",
        "--fresh-trainer",
        "--predict-runs=3",
        "--fit-epochs=2",
        "--fit-val-batches=2",
        "--fit-train-batches=1",
        f"--output={output}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(output.read_text())
    keys = [(row["workload"], row["batches"], row["run"], row["trainer"]) for row in rows]
    predict_keys = [
        (workload, 2, run, trainer)
        for workload in ("vit_b_16/batch_1", "packed_vit_small/mixed_batch_8")
        for run, trainer in (
            ("first", "reused"),
            ("second", "reused"),
            ("third", "reused"),
            ("second", "fresh"),
        )
    ]
    assert keys == [*predict_keys, ("fit/packed_vit_small/mixed_batch_8", 4, "epochs_1-2", None)]
    for row in rows:
        assert set(ROW_KEYS) <= set(row)
        assert row["eager_tower_s"] > 0 and row["callback_tower_s"] > 0
        assert row["vs_eager"] == pytest.approx(row["eager_tower_s"] / row["callback_tower_s"])
        assert isinstance(row["graphs_captured"], int) and row["capture_s"] >= 0
        # No compile on the CPU: the fields are there, empty.
        assert row["compile_tower_s"] is None and row["vs_compile"] is None
    for row in rows[:-1]:
        assert row["callback_max_abs_diff"] < 1e-4
        assert row["images"] == row["batches"] * (1 if "batch_1" in row["workload"] else 8)
        assert row["callback_stats"]["items"] == row["images"]
    fit = rows[-1]
    assert len(fit["eager_epoch_tower_s"]) == len(fit["callback_epoch_tower_s"]) == 2
    assert fit["callback_tower_s"] == pytest.approx(sum(fit["callback_epoch_tower_s"]))
    assert "vit_b_16/batch_1 2 batches, first run" in result.stdout

    merged = tmp_path / "merged.json"
    merged.write_text(json.dumps([{**rows[0], "compile_tower_s": 1.0}]))
    meta = output.with_suffix(".meta.json")
    assert json.loads(meta.read_text())[0]["methods"] == ["eager", "callback"]
    result = bench_trainer("--from-json", str(output), str(meta), f"--output={merged}")
    assert result.returncode == 0, result.stderr[-3000:]
    merged_rows = json.loads(merged.read_text())
    assert merged_rows[1:] == rows[1:] and merged_rows[0]["compile_tower_s"] == 1.0


def test_repeats_report_the_median_run_of_each_method(tmp_path):
    output = tmp_path / "trainer.json"
    result = bench_trainer(
        "--tiny",
        "--batches=2",
        "--workloads=vit_b_16/batch_1",
        "--methods",
        "eager",
        "callback",
        "--repeats=3",
        f"--output={output}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(output.read_text())
    assert [row["run"] for row in rows] == ["first", "second"]
    for row in rows:
        assert row["repeats"] == 3
        for method in ("eager", "callback"):
            repeats = row[f"{method}_tower_s_repeats"]
            assert len(repeats) == 3 and row[f"{method}_tower_s"] == sorted(repeats)[1]
        assert row["vs_eager"] == pytest.approx(row["eager_tower_s"] / row["callback_tower_s"])


def test_callback_outputs_equal_eager_outputs_on_mixed_sizes():
    workload = Workload.parse("packed_vit_small/mixed_batch_8")
    tower = make_tower(workload, TINY_SIZES, seed=0)
    batches = SyntheticBatches(workload, tower, 3, TINY_SIZES, seed=0, device=torch.device("cpu"))
    eager = predict_runs(tower, batches, "eager", CPU)
    # first_use: the graph path from the first batch, whatever the run's length.
    first_use = TrainerSettings("cpu", "32-true", callback_kwargs={"capture": "first_use"})
    graphed = predict_runs(tower, batches, "callback", first_use)
    for run in ("first", "second"):
        # The callback served every image, padded into budgets, yet gave eager's outputs.
        assert graphed[run].record.stats["items"] == batches.images()
        assert graphed[run].record.stats["padded_tokens"] > 0
        assert len(graphed[run].outputs) == len(eager[run].outputs) == 3
        for graph_out, eager_out in zip(graphed[run].outputs, eager[run].outputs, strict=True):
            torch.testing.assert_close(graph_out, eager_out, rtol=1e-4, atol=1e-5)


def test_batches_are_seeded_and_a_shorter_run_is_a_prefix():
    workload = Workload.parse("packed_vit/mixed_batch_8")
    tower = make_tower(workload, TINY_SIZES, seed=0)
    cpu = torch.device("cpu")
    short, long = (SyntheticBatches(workload, tower, n, TINY_SIZES, 0, cpu) for n in (2, 5))
    other = SyntheticBatches(workload, tower, 2, TINY_SIZES, 1, cpu)
    for index in range(2):
        for key in ("pixel_patches", "grid_thw", "targets"):
            assert torch.equal(short[index][key], long[index][key])
        assert not torch.equal(short[index]["pixel_patches"], other[index]["pixel_patches"])
    sides = {side for batch in long for side in batch["grid_thw"][:, 1:].flatten().tolist()}
    assert len(sides) > 1  # mixed sizes, in patches
    assert all(len(batch["grid_thw"]) == 8 for batch in long)


def test_a_later_invocation_fills_in_the_methods_it_ran():
    key = {"workload": "vit_b_16/batch_8", "batches": 10, "run": "first", "trainer": "reused"}
    old = {**key, "eager_tower_s": 2.0, "callback_tower_s": 1.0, "compile_tower_s": None}
    new = {**key, "eager_tower_s": None, "callback_tower_s": None, "compile_tower_s": 4.0}
    other = {**key, "batches": 100, "eager_tower_s": 3.0, "callback_tower_s": None}
    merged = merge_rows([old], [new, other])
    assert merged[0]["eager_tower_s"] == 2.0 and merged[0]["compile_tower_s"] == 4.0
    assert merged[0]["vs_eager"] == 2.0 and merged[0]["vs_compile"] == 4.0
    assert merged[1] == other


@pytest.mark.parametrize(
    "name",
    [
        "vit_b_32/batch_8",
        "vit_b_16/mixed_batch_8",
        "packed_vit/batch_8",
        "vit_b_16/batch_0",
        "clip_vit_b32/batch_8",
        "clip_vit_b16/mixed_batch_8",
        "qwen2_vl_vision/batch_8",
        "qwen2_vl/mixed_batch_8",
    ],
)
def test_bad_workload_names_the_field(name):
    with pytest.raises(ValueError, match=f"workloads has '{name}'"):
        Workload.parse(name)


# (id, arguments, what the parser's refusal says)
REFUSED_ARGUMENTS = [
    ("kwargs a list", ["--callback-kwargs", "[1, 2]"], "--callback-kwargs: must be a JSON object"),
    (
        "kwargs not JSON",
        ["--callback-kwargs", "{capture"],
        "--callback-kwargs: must be a JSON object",
    ),
    (
        "kwargs a bad option",
        ["--callback-kwargs", '{"capture": "later"}'],
        "capture must be one of paid_back, first_use, upfront; got capture='later'",
    ),
    (
        "kwargs naming module",
        ["--callback-kwargs", '{"module": "tower"}'],
        "multiple values for keyword argument 'module'",
    ),
    (
        "a missing row file",
        ["--from-json", "missing.json"],
        "--from-json: no such file: missing.json",
    ),
    ("min-side 0", ["--min-side", "0"], "--min-side: must be a positive integer; got '0'"),
    ("max-side -5", ["--max-side=-5"], "--max-side: must be a positive integer; got '-5'"),
    (
        "an unknown precision",
        ["--precision", "fp7", "--check"],
        "--precision: invalid choice: 'fp7' (choose from 'bf16-mixed', 'bf16-true'",
    ),
]


@pytest.mark.parametrize(
    ("arguments", "refusal"),
    [row[1:] for row in REFUSED_ARGUMENTS],
    ids=[row[0] for row in REFUSED_ARGUMENTS],
)
def test_a_bad_argument_is_refused_by_the_parser_naming_it(arguments, refusal, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        load_script().parse_args([*arguments, f"--output={tmp_path / 'rows.json'}"])
    assert exited.value.code == 2
    assert refusal in capsys.readouterr().err


@pytest.mark.cuda
def test_every_method_on_cuda(tmp_path):
    output = tmp_path / "trainer.json"
    result = bench_trainer(
        "--tiny",
        "--batches=3",
        "--workloads",
        "vit_b_16/batch_8",
        "packed_vit_small/mixed_batch_8",
        "fit/vit_b_16/batch_8",
        "--fit-epochs=2",
        "--fit-val-batches=3",
        # Graphs at first use: the rows must show a capture on runs this short.
        '--callback-kwargs={"capture": "first_use"}',
        f"--output={output}",
        device="cuda",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(output.read_text())
    assert [row["run"] for row in rows] == ["first", "second", "first", "second", "epochs_1-2"]
    for row in rows[:-1]:
        assert row["compile_tower_s"] > 0 and row["vs_compile"] > 0
        assert row["callback_max_abs_diff"] < 0.1 and row["compile_max_abs_diff"] < 0.1
    first = rows[0]
    assert first["graphs_captured"] > 0 and first["capture_s"] > 0


def test_multiscale_validates_four_times_on_batches_of_every_side(tmp_path, one_thread, capsys):
    rows = bench_trainer_here(tmp_path, *TINY_MULTISCALE, "--check")
    assert [(row["run"], row["trainer"]) for row in rows] == [
        ("first", "reused"),
        ("second", "reused"),
        ("third", "reused"),
        ("fourth", "reused"),
    ]
    for row in rows:
        assert row["workload"] == "multiscale/resnet50/batch_2" and row["batches"] == 4
        assert row["sides"] == [32, 40, 48, 56] and row["images"] == 8
        assert row["eager_tower_s"] > 0 and row["callback_tower_s"] > 0
        assert row["vs_eager"] == pytest.approx(row["eager_tower_s"] / row["callback_tower_s"])
        assert isinstance(row["graphs_captured"], int) and isinstance(row["callback_replays"], int)
        assert row["callback_stats"]["items"] == 8  # every image of the run went through it
        assert row["callback_max_rel_diff"] < 1e-4
    out = capsys.readouterr().out
    assert "multiscale/resnet50/batch_2 4 batches, fourth run (reused trainer)" in out
    assert "sides 32/40/48/56" in out
    assert "check ok: multiscale/resnet50/batch_2 4 batches: graphs captured per run" in out


def test_multiscale_batches_cycle_through_the_sides_and_validation_keeps_outputs(one_thread):
    workload = Workload.parse("multiscale/resnet50/batch_2")
    tower = make_tower(workload, TINY_SIZES, seed=0)
    batches = SyntheticBatches(workload, tower, 6, TINY_SIZES, seed=0, device=torch.device("cpu"))
    assert [batch["images"].shape[-2:] for batch in batches] == [
        (side, side) for side in (32, 40, 48, 56, 32, 40)
    ]
    assert all(batch["images"].is_contiguous() for batch in batches)
    assert [batch["images"].shape[-1] for batch in batches.shape_examples()] == [32, 40, 48, 56]
    runs = validate_runs(tower, batches, "eager", CPU)
    assert list(runs) == ["first", "second", "third", "fourth"]
    with torch.inference_mode():
        expected = [tower(batch["images"]) for batch in batches]
    for run in runs.values():
        assert run.record.calls == 6
        for output, reference in zip(run.outputs, expected, strict=True):
            torch.testing.assert_close(output, reference)


def test_each_workload_takes_its_own_batches_unless_asked(tmp_path):
    script = load_script()
    settings = script.resolve_settings(
        script.parse_args(["--device=cpu", "--workloads", "multiscale/resnet50/batch_16"])
    )
    assert settings.batches is None and settings.workloads[0].default_batches == (48,)
    assert MULTISCALE_BATCHES == (48,) and PREDICT_BATCHES == (10, 100, 1000)
    assert Workload.parse("vit_b_16/batch_8").default_batches == PREDICT_BATCHES
    given = script.resolve_settings(script.parse_args(["--device=cpu", "--batches", "4", "8"]))
    assert given.batches == [4, 8]
    with pytest.raises(ValueError, match="workloads has 'multiscale/vit_b_16/batch_8'"):
        Workload.parse("multiscale/vit_b_16/batch_8")  # a ViT takes one image side only
    with pytest.raises(ValueError, match="--check-tolerance must be > 0"):
        script.resolve_settings(script.parse_args(["--device=cpu", "--check-tolerance=0"]))


def test_check_passes_on_a_tiny_predict_workload(tmp_path, one_thread, capsys):
    rows = bench_trainer_here(tmp_path, "--workloads=vit_b_16/batch_1", "--batches=2", "--check")
    assert [row["run"] for row in rows] == ["first", "second"]
    assert rows[1]["graphs_captured"] == 0
    line = "check ok: vit_b_16/batch_1 2 batches: graphs captured per run 0/0, largest difference"
    assert line in capsys.readouterr().out


def perturbed(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [output * 1.5 for output in outputs]  # a relative difference of 0.5


def captured_again(runs: dict) -> None:
    """The second run reports graphs captured that the callback does not hold after it."""
    runs["second"].record.graphs_captured = 2


def with_outputs_perturbed(runs: dict) -> None:
    runs["first"].outputs = perturbed(runs["first"].outputs)


@pytest.mark.parametrize(
    ("spoil", "message"),
    [
        (
            with_outputs_perturbed,
            "check failed: vit_b_16/batch_1 2 batches, first run, batch 0: "
            "relative difference 5.0e-01 of the callback's outputs to eager's, "
            "above the tolerance 1e-04",
        ),
        (
            captured_again,
            "check failed: vit_b_16/batch_1 2 batches, second run: "
            "the callback held 0 graphs after it, 0 before and captured 2; "
            "graphs must be kept across runs",
        ),
    ],
)
def test_check_fails_naming_the_run_and_value(tmp_path, one_thread, monkeypatch, spoil, message):
    def spoiled_predict_runs(tower, batches, method, *args, **kwargs):
        runs = predict_runs(tower, batches, method, *args, **kwargs)
        if method == "callback":
            spoil(runs)
        return runs

    monkeypatch.setattr(bench.trainer.suite, "predict_runs", spoiled_predict_runs)
    with pytest.raises(SystemExit) as failure:
        bench_trainer_here(tmp_path, "--workloads=vit_b_16/batch_1", "--batches=2", "--check")
    assert str(failure.value) == message
    # The rows are written before the check stops the benchmark.
    assert len(json.loads((tmp_path / "trainer.json").read_text())) == 2


def test_check_fails_when_multiscale_outputs_differ(tmp_path, one_thread, monkeypatch):
    def spoiled_validate_runs(tower, batches, method, *args, **kwargs):
        runs = validate_runs(tower, batches, method, *args, **kwargs)
        if method == "callback":
            runs["third"].outputs = runs["third"].outputs[:3] + perturbed(runs["third"].outputs[3:])
        return runs

    monkeypatch.setattr(bench.trainer.suite, "validate_runs", spoiled_validate_runs)
    with pytest.raises(SystemExit, match="third run, batch 3: relative difference 5.0e-01"):
        bench_trainer_here(tmp_path, *TINY_MULTISCALE, "--check")


def test_merged_rows_are_drawn_as_speedups_of_the_callback_and_torch_compile(tmp_path):
    row = {key: None for key in ROW_KEYS} | {
        "workload": "vit_b_16/batch_8",
        "batches": 100,
        "run": "second",
        "eager_tower_s": 0.6,
        "callback_tower_s": 0.2,
        "vs_eager": 3.0,
        "compile_tower_s": 0.3,
    }
    bars = speedup_bars([row])
    assert [(bar["method"], bar["vs_eager"]) for bar in bars] == [
        ("lightning-cg", 3.0),
        ("torch.compile reduce-overhead", pytest.approx(2.0)),
    ]
    assert {bar["workload"] for bar in bars} == {"vit_b_16/batch_8 100 second"}
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps([row]))
    plot = tmp_path / "trainer.png"
    load_script().main(
        ["--from-json", str(rows), f"--output={tmp_path / 'merged.json'}", f"--plot={plot}"]
    )
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
