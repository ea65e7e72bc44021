"""End-to-end benchmark through the Lightning Trainer: eager, the callback, torch.compile.

A user-style LightningModule holds the tower at ``self.backbone`` and calls it
in ``predict_step`` / ``validation_step``, timed with a synchronize on each
side. For each workload and run length it runs ``trainer.predict`` twice per
method (``first`` and ``second`` run: one module, one callback, one Trainer)
and sums the tower seconds of each run; fit workloads train for a few epochs
with a validation loop each epoch and sum the validation tower seconds.
A multiscale workload (``multiscale/resnet50/batch_16``) runs ``trainer.validate``
four times (``first`` to ``fourth`` run: one module, one callback,
one Trainer) on batches whose image side cycles through 224, 256, 288 and 320
(batch ``i`` has side ``sides[i % 4]``; ``--tiny``: 32, 40, 48, 56).

Each workload carries its own run lengths: 10, 100 and 1000 batches for
predict workloads, 48 for multiscale ones; ``--batches`` replaces them for
every predict and multiscale workload of the invocation (fits take
``--fit-val-batches``). ``--check`` checks each workload after its rows are
written and exits with an error naming the workload, run and value when the
callback lost graphs between runs (it holds fewer after a run than it held before
plus the run's captures), or when its outputs differ from eager's by more than the
precision allows (relative norm: 2e-2 under bf16-mixed, 1e-4 in 32-true;
``--check-tolerance`` sets another).

    python scripts/bench_trainer.py                                   # everything (GPU: in pieces)
    python scripts/bench_trainer.py --workloads vit_b_16/batch_8 --batches 10 100
    python scripts/bench_trainer.py --workloads packed_vit/mixed_batch_8 --batches 1000 \\
        --methods eager callback
    python scripts/bench_trainer.py --workloads fit/vit_b_16/batch_8 --fit-epochs 5
    python scripts/bench_trainer.py --workloads multiscale/resnet50/batch_16 \\
        --check                                         # 48 batches of 4 sides, validated 4 times
    python scripts/bench_trainer.py --workloads vit_b_16/batch_8 --batches 100 --check
    python scripts/bench_trainer.py --workloads vit_b_16/batch_1 --batches 10 --repeats 5 \
        --methods eager callback                        # the median of 5 fresh repeats
    python scripts/bench_trainer.py --workloads clip_vit_b16/batch_8 \
        qwen2_vl_vision/mixed_batch_8 --batches 100     # transformers towers (the hf extra)
    python scripts/bench_trainer.py --device cpu --tiny --batches 2 --fit-epochs 2 \\
        --fit-val-batches 2 --output /tmp/trainer.json

Rows are merged into ``--output`` (default benchmarks/h100-trainer.json) after
each workload, so runs split over several invocations add up to one file; a
later invocation replaces the methods it ran in rows it shares with the file.
``--from-json a.json b.json`` merges row files the same way and runs nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

# scripts/bench.py would shadow the bench package: look in the repo root instead of here.
ROOT = Path(__file__).resolve().parents[1]
if sys.path[0] and Path(sys.path[0]).resolve() == ROOT / "scripts":
    sys.path[0] = str(ROOT)
else:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.report import plot_speedups  # noqa: E402
from bench.trainer.checks import PRECISIONS, tolerance  # noqa: E402
from bench.trainer.rows import (  # noqa: E402
    markdown_table,
    merge_rows,
    read_rows,
    speedup_bars,
    write_json,
)
from bench.trainer.runs import COMPILE, METHODS, TrainerSettings  # noqa: E402
from bench.trainer.suite import BenchSettings, run_benchmark  # noqa: E402
from bench.trainer.workloads import (  # noqa: E402
    FIT_WORKLOADS,
    FULL_SIZES,
    HF_WORKLOADS,
    MULTISCALE_BATCHES,
    MULTISCALE_WORKLOADS,
    PREDICT_BATCHES,
    PREDICT_WORKLOADS,
    TINY_SIZES,
    Workload,
)
from lightning_cg import CUDAGraphCallback  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--workloads",
        nargs="+",
        default=[*PREDICT_WORKLOADS, *FIT_WORKLOADS],
        help="[fit/]<tower>/batch_<n>, [fit/]<tower>/mixed_batch_<n> or "
        "multiscale/<tower>/batch_<n>; default: "
        + " ".join([*PREDICT_WORKLOADS, *FIT_WORKLOADS])
        + "; the transformers towers (called as their users call them): "
        + " ".join(HF_WORKLOADS)
        + "; validation over images of four sides, four trainer.validate runs: "
        + " ".join(MULTISCALE_WORKLOADS),
    )
    parser.add_argument(
        "--batches",
        nargs="+",
        type=int,
        default=None,
        help="run lengths of the predict and multiscale workloads, in batches; default: "
        "each workload's own ("
        + " ".join(map(str, PREDICT_BATCHES))
        + " for predict workloads, "
        + " ".join(map(str, MULTISCALE_BATCHES))
        + " for multiscale ones)",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        default=list(METHODS),
        choices=METHODS,
        help="compile: the tower under torch.compile(mode='reduce-overhead')",
    )
    parser.add_argument(
        "--fresh-trainer",
        action="store_true",
        help="also predict once more on a new Trainer (second run, fresh trainer)",
    )
    parser.add_argument(
        "--predict-runs",
        type=int,
        default=2,
        choices=(2, 3, 4),
        help="trainer.predict runs per method on one Trainer (first, second, third, fourth)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="predict workloads: run each method's runs this many times afresh, "
        "alternating the methods' order, and report the median (short runs are noisy)",
    )
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    parser.add_argument(
        "--precision",
        default=None,
        choices=PRECISIONS,
        help="Lightning precision (default: bf16-mixed on CUDA, 32-true on CPU)",
    )
    parser.add_argument("--tiny", action="store_true", help="tiny towers and images (CPU smoke)")
    parser.add_argument(
        "--min-side",
        type=positive_int,
        default=None,
        help="smallest side of the mixed-size images (default 64; tiny: 32)",
    )
    parser.add_argument(
        "--max-side",
        type=positive_int,
        default=None,
        help="largest side of the mixed-size images (default 1024; tiny: 96)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fit-epochs", type=int, default=5)
    parser.add_argument("--fit-val-batches", type=int, default=50)
    parser.add_argument("--fit-train-batches", type=int, default=2)
    parser.add_argument(
        "--callback-kwargs",
        type=json_object,
        default={},
        help='CUDAGraphCallback arguments, a JSON object: {"capture": "upfront"}',
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="after each workload, fail unless the callback kept its graphs across runs "
        "(a later run captures only new keys) and its outputs equal eager's",
    )
    parser.add_argument(
        "--check-tolerance",
        type=float,
        default=None,
        help="the largest relative difference (norm of the difference over eager's) "
        "that --check allows per batch; default: 2e-2 under bf16, 1e-4 in float32",
    )
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "h100-trainer.json")
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="also draw the rows (merged or run) as bars of speed-up over eager, a PNG",
    )
    parser.add_argument(
        "--table",
        action="store_true",
        help="also print the rows (merged or run) as BENCHMARKS.md's markdown table",
    )
    parser.add_argument(
        "--from-json",
        nargs="+",
        type=Path,
        default=[],
        help="merge the rows of these files into --output and run nothing",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="start --output anew instead of merging into its rows",
    )
    args = parser.parse_args(argv)
    missing = [str(path) for path in args.from_json if not path.is_file()]
    if missing:
        parser.error(f"--from-json: no such file: {', '.join(missing)}")
    try:
        CUDAGraphCallback(module="backbone", **args.callback_kwargs)
    except (TypeError, ValueError) as error:
        parser.error(f"--callback-kwargs={json.dumps(args.callback_kwargs)}: {error}")
    return args


def positive_int(text: str) -> int:
    """An argument that must be a positive integer (argparse names the option)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {text!r}")
    return value


def json_object(text: str) -> dict:
    """``--callback-kwargs``: a JSON object of CUDAGraphCallback arguments."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"must be a JSON object; got {text!r} ({error})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f'must be a JSON object like {{"capture": "upfront"}}; got {text!r}'
        )
    return value


def resolve_settings(args: argparse.Namespace) -> BenchSettings:
    """Check the arguments and fill the defaults that depend on the device.

    Raises:
        ValueError: an argument is out of range; the message names it.
    """
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    for name in ("batches", "repeats", "fit_epochs", "fit_val_batches", "fit_train_batches"):
        values = getattr(args, name)
        if values is not None and min(values if isinstance(values, list) else [values]) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1; got {values}")
    methods = list(dict.fromkeys(args.methods))
    if device == "cpu" and COMPILE in methods:
        print("compile: needs CUDA (reduce-overhead is CUDA graphs); left out on the CPU")
        methods.remove(COMPILE)
    base = TINY_SIZES if args.tiny else FULL_SIZES
    low, high = base.mixed_sides
    sides = (
        low if args.min_side is None else args.min_side,
        high if args.max_side is None else args.max_side,
    )
    if not 0 < sides[0] <= sides[1]:
        raise ValueError(f"need 0 < --min-side <= --max-side; got {sides[0]} and {sides[1]}")
    precision = args.precision or ("bf16-mixed" if device == "cuda" else "32-true")
    if args.check_tolerance is not None and not args.check_tolerance > 0:
        raise ValueError(f"--check-tolerance must be > 0; got {args.check_tolerance}")
    if args.check and args.check_tolerance is None:
        tolerance(precision)  # a precision of no known tolerance fails now, not after a run
    return BenchSettings(
        workloads=[Workload.parse(name) for name in args.workloads],
        batches=args.batches,
        methods=methods,
        trainer=TrainerSettings(device, precision, args.callback_kwargs),
        sizes=replace(base, mixed_sides=sides),
        seed=args.seed,
        fresh_trainer=args.fresh_trainer,
        predict_runs=args.predict_runs,
        repeats=args.repeats,
        fit_epochs=args.fit_epochs,
        fit_val_batches=args.fit_val_batches,
        fit_train_batches=args.fit_train_batches,
        output=args.output,
        overwrite=args.overwrite,
        check=args.check,
        check_tolerance=args.check_tolerance,
    )


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.from_json:
        rows = [] if args.overwrite else read_rows(args.output)
        # Run metadata lie beside the rows; a shell glob picks them up too.
        for path in [path for path in args.from_json if not path.name.endswith(".meta.json")]:
            rows = merge_rows(rows, read_rows(path, check=True))
        write_json(args.output, rows)
        print(f"{len(rows)} rows in {args.output}")
    else:
        settings = resolve_settings(args)
        rows = run_benchmark(settings)
        print(f"{len(rows)} rows merged into {settings.output}")
    if args.plot is not None and plot_speedups(speedup_bars(rows), args.plot) is not None:
        print(f"plot in {args.plot}")
    if args.table:
        print(markdown_table(rows))
    return rows


if __name__ == "__main__":
    main()
