import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def row(
    workload: str,
    run: str,
    vs_eager: float,
    captured: int = 0,
    held: int = 1,
    callback_s: float | None = None,
) -> dict:
    stats = {"graphs": float(held)}
    return dict(
        workload=workload,
        batches=100,
        run=run,
        vs_eager=vs_eager,
        graphs_captured=captured,
        callback_stats=stats,
        callback_tower_s=callback_s,
    )


def compare(tmp_path: Path, current: list[dict], reference: list[dict], *flags: str):
    paths = []
    for name, rows in (("current", current), ("reference", reference)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(rows))
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compare_trainer.py"), *map(str, paths), *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_rows_that_keep_every_target_pass(tmp_path):
    current = [
        row("vit/batch_8", "first", 2.0, captured=1, callback_s=0.3),
        row("vit/batch_8", "second", 3.5, callback_s=0.2),
    ]
    reference = [
        row("vit/batch_8", "first", 2.0, callback_s=0.25),
        row("vit/batch_8", "second", 3.6),
    ]
    result = compare(tmp_path, current, reference)
    assert result.returncode == 0, result.stdout
    lines = result.stdout.splitlines()
    assert lines[0] == (
        "vit/batch_8 100 batches, first run: 2.00x eager, reference 2.00x, 1.00 of it; "
        "1 captured, 1 held; callback 0.300 s, 1.20 of the reference's"
    )
    # Without the reference's seconds there is no quotient to give.
    assert lines[1] == (
        "vit/batch_8 100 batches, second run: 3.50x eager, reference 3.60x, 0.97 of it; "
        "0 captured, 1 held"
    )


def test_each_missed_target_is_named(tmp_path):
    sides = "multiscale/resnet50/batch_16"
    current = [
        row("vit/batch_8", "first", 0.9),
        row("vit/batch_8", "second", 3.0, captured=2),
        row(sides, "third", 1.2, held=3),
        row(sides, "fourth", 1.5, held=4),
    ]
    reference = [row("vit/batch_8", "first", 1.0), row("vit/batch_8", "second", 3.0)]
    result = compare(tmp_path, current, reference)
    assert result.returncode == 1
    missed = [line for line in result.stdout.splitlines() if line.startswith("MISSED")]
    assert missed == [
        "MISSED vit/batch_8 100 batches, first run: 0.90 of the reference, below 0.97",
        "MISSED vit/batch_8 100 batches, first run: first run 0.90x eager, below 0.95x",
        "MISSED vit/batch_8 100 batches, second run: a later run captured 2 graphs",
        f"MISSED {sides} 100 batches, third run: 3 graphs, not 4",
        f"MISSED {sides} 100 batches, fourth run: 1.50x eager, below 1.8x",
    ]


def test_table_prints_each_row_against_the_reference(tmp_path):
    def timed(run: str, eager: float, callback: float, captured: int) -> dict:
        return {
            **row("vit/batch_8", run, eager / callback, captured=captured),
            "eager_tower_s": eager,
            "callback_tower_s": callback,
        }

    current = [timed("first", 0.6, 0.3, 1), timed("second", 0.6, 0.2, 0)]
    reference = [timed("first", 0.5, 0.25, 1)]
    result = compare(tmp_path, current, reference, "--table")
    assert result.stdout.splitlines()[2:] == [
        "| vit/batch_8 (100) | first | 0.600 / 0.300, 2.00x, 1 | 0.500 / 0.250, 2.00x, 1 "
        "| 1.00 | 1.20 |",
        "|  | second | 0.600 / 0.200, 3.00x, 0 | - | - | - |",
    ]
