"""Bad inputs, one row each: every one refused before any work starts, naming its field.

Hydra rows compose an app's config with the overrides and run it through
:func:`lightning_cg.app.runner.run` with the Trainer's construction replaced by a
failure: a row must be refused by Hydra itself (the structured schema) or by
the checks before the Trainer (:mod:`lightning_cg.app.preflight`). Python rows call
the public constructors. A row whose input is accepted fails: nothing in the
table is silently accepted. Each row names the field its message must name.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
from hydra.errors import ConfigCompositionException, HydraException
from hydra.utils import get_class
from omegaconf import OmegaConf
from test_app import CONF, ROOT, TINY_TOWER, TINY_VIT, compose_config

import lightning_cg.app.runner
from bench.settings import resolve_settings
from examples.models.lit import build_tower
from lightning_cg.adapters.packed import PackedEncoderAdapter
from lightning_cg.callback.graph_callback import CUDAGraphCallback
from lightning_cg.engine.config import BudgetConfig, GraphConfig
from lightning_cg.engine.manager import EncoderGraphManager
from lightning_cg.serve.graphed import graphed

#: Seconds a refusal may take: composing, and at most building the model.
FAST_SECONDS = 20
#: What a refusal may raise; never an AttributeError or a TypeError from deep inside.
REFUSALS = (ValueError, TypeError, HydraException)

# (app, overrides, field the message names)
HYDRA_ROWS = [
    # flags take exactly true or false
    ("predict", ["cudagraph.compile=maybe"], "compile"),
    ("predict", ["cudagraph.keep_graphs=yes"], "keep_graphs"),
    ("predict", ["compare_eager=maybe"], "compare_eager"),
    ("train", ["compare_eager=sometimes"], "compare_eager"),
    ("validate", ["cudagraph.keep_graphs=1"], "keep_graphs"),
    ("predict", ["cudagraph.cast_weights_per_run=yes"], "cast_weights_per_run"),
    ("predict", ["cudagraph.encoder_data_parallel=2"], "encoder_data_parallel"),
    # the app's stage must be one the callback serves
    ("predict", ["cudagraph.stages=[validate]"], "cudagraph.stages"),
    ("train", ["cudagraph.stages=[test,predict]"], "cudagraph.stages"),
    # budgets: integers, in a list, in range
    ("predict", ["cudagraph.budgets.budgets=[64.9,128.7]"], "budgets"),
    ("predict", ["cudagraph.budgets.budgets=[true,64]"], "budgets"),
    ("predict", ["cudagraph.budgets.budgets=pow2"], "budgets"),
    ("predict", ["cudagraph.budgets.budgets=[]"], "budgets"),
    ("predict", ["cudagraph.budgets.budgets=[0,64]"], "budgets"),
    ("predict", ["cudagraph.budgets.max_budget=abc"], "max_budget"),
    ("predict", ["cudagraph.budgets.max_budget=64.5"], "max_budget"),
    ("predict", ["cudagraph.budgets.min_budget=0"], "min_budget"),
    (
        "predict",
        ["cudagraph.budgets.min_budget=512", "cudagraph.budgets.max_budget=64"],
        "min_budget",
    ),
    ("predict", ["cudagraph.budgets.ladder=best"], "ladder"),
    ("predict", ["cudagraph.budgets.ladder=auto"], "ladder"),
    ("predict", ["cudagraph.budgets.ratio=0.5"], "ratio"),
    ("predict", ["cudagraph.budgets.ratio=abc"], "ratio"),
    ("predict", ["cudagraph.budgets.ratio=inf"], "ratio"),
    ("predict", ["cudagraph/budgets=geometric", "cudagraph.budgets.align=0"], "align"),
    ("predict", ["+cudagraph.budgets.bogus=1"], "bogus"),
    # sizes that cannot work
    ("predict", ["cudagraph.budgets.max_budget=99999999"], "max_budget"),
    ("predict", ["cudagraph.budgets.budgets=[64,10000000000]"], "budgets"),
    ("predict", ["+cudagraph.paths.global.max_budget=99999999"], "paths.global.max_budget"),
    # other options
    ("predict", ["cudagraph.stages=validate"], "stages"),
    ("predict", ["cudagraph.stages=[validate,fit]"], "stages"),
    ("predict", ["cudagraph.stages=[]"], "stages"),
    ("predict", ["cudagraph.module=123"], "module"),
    ("predict", ["cudagraph.module=model..visual"], "module"),
    ("predict", ["cudagraph.module=head"], "module"),
    ("predict", ["cudagraph.mode=fast"], "mode"),
    ("predict", ["cudagraph.packing=best"], "packing"),
    ("predict", ["cudagraph.adapter=packd"], "adapter"),
    # an adapter node built before the tower exists
    (
        "predict",
        ["cudagraph.adapter={_target_: lightning_cg.adapters.packed.PackedEncoderAdapter}"],
        "_partial_",
    ),
    ("predict", ["cudagraph.capture=eventually"], "capture"),
    ("predict", ["cudagraph.max_items_per_batch=0"], "max_items_per_batch"),
    ("predict", ["cudagraph.max_items_per_batch=true"], "max_items_per_batch"),
    ("predict", ["cudagraph.max_frames_per_batch=-1"], "max_frames_per_batch"),
    ("predict", ["cudagraph.mode=piecewise"], "mode"),
    ("predict", ["cudagraph.mode=none", "cudagraph.compile=true"], "compile"),
    ("predict", ["cudagraph.paths=abc"], "paths"),
    ("predict", ["+cudagraph.paths.glob.max_budget=64"], "paths"),
    ("predict", ["+cudagraph.paths.local.ratio=0.9"], "ratio"),
    ("predict", ["cudagraph.paths={glob:{max_budget:64}}"], "glob"),
    ("predict", ["cudagraph.paths={local:{budgts:[64]}}"], "budgts"),
    ("predict", ["cudagraph.paths={local:{max_budget:abc}}"], "max_budget"),
    ("predict", ["+cudagraph.verfy=true"], "verfy"),
    # a geometric ladder left only its two ends
    ("predict", ["cudagraph/budgets=geometric", "cudagraph.budgets.ratio=1e308"], "ratio"),
    ("predict", ["cudagraph/budgets=geometric", "cudagraph.budgets.align=1000000000"], "align"),
    # an option a batch-first tower would only turn into eager runs
    (
        "predict",
        [*TINY_VIT, "data=fake", "cudagraph.max_frames_per_batch=2"],
        "max_frames_per_batch",
    ),
    # the app's own keys
    ("predict", ["+pases=3"], "pases"),
    ("predict", ["passes=many"], "passes"),
    ("predict", ["passes=0"], "passes"),
    ("predict", ["seed=1.5"], "seed"),
    # model and data that disagree, or a data module that cannot feed the tower
    ("predict", ["model=packed_vit_small", "data=fake"], "data"),
    ("predict", ["model=vit_b_16", "data=synthetic"], "data"),
    ("predict", ["model=resnet50", "data=synthetic"], "data"),
    ("predict", ["model=vit_b_16", "data=photos", "data.fixed_size=null"], "data"),
    ("predict", ["data.merge_size=3"], "merge_size"),
    ("predict", ["data=synthetic", "data.num_items=-5"], "num_items"),
    ("predict", ["model=vit_b_16", "data=fake", "data.num_items=0"], "num_items"),
    ("predict", ["data=synthetic", "data.batch_size=0"], "batch_size"),
    ("predict", ["data.repeats=0"], "repeats"),
    ("predict", ["data=synthetic", "data.patch_size=14"], "patch_size"),
    ("validate", ["model=vit_b_16", "data=fake", "data.image_size=64"], "image_size"),
    (
        "predict",
        ["model=vit_b_16", "data=fake", "model.input.image_size=160"],
        "model.input.image_size=160 disagrees with the tower VisionTransformer",
    ),
    (
        "predict",
        ["model=qwen2_vl_vision", "data=synthetic", "data.temporal_patch_size=1"],
        "temporal_patch_size",
    ),
    ("predict", [*TINY_TOWER, "+model.module.vision_tower.patch_size=8"], "patch_size"),
]


# (overrides of conf/bench.yaml, field the message names): refused by resolve_settings,
# before any workload runs
BENCH_ROWS = [
    (["quick=maybe"], "quick"),
    (["tiny=yes"], "tiny"),
    (["fail_fast=1"], "fail_fast"),
    (["seed=1.5"], "seed"),
    (["batch_sizes=[1.5]"], "batch_sizes"),
    (["repeats=true"], "repeats"),
    (["manager.cast_weights_per_run=no"], "cast_weights_per_run"),
    (["manager.packing=best"], "packing"),
    (["manager.budgets.ladder=foo"], "ladder"),
    (["manager.budgets.ratio=2.0"], "ratio=2.0 applies only"),
    (["dtype=float8"], "dtype"),
    (["methods=[fastest]"], "methods"),
]


def tiny_adapter() -> PackedEncoderAdapter:
    tower = build_tower(
        "packed_vit_small", depth=1, hidden_size=32, num_heads=2, out_hidden_size=16
    )
    return PackedEncoderAdapter(tower)


def callback(**options):
    return lambda: CUDAGraphCallback(**options)


def graph_config(**options):
    return lambda: GraphConfig.from_options(**options)


def manager(**options):
    return lambda: EncoderGraphManager(tiny_adapter(), **options)


def served(**options):
    return lambda: graphed(tiny_adapter().tower, **options)


# (id, call, field the message names)
PYTHON_ROWS = [
    (
        "callback cast_weights_per_run='no'",
        callback(cast_weights_per_run="no"),
        "cast_weights_per_run",
    ),
    ("callback compile='maybe'", callback(compile="maybe"), "compile"),
    ("callback keep_graphs='yes'", callback(keep_graphs="yes"), "keep_graphs"),
    (
        "callback encoder_data_parallel='true'",
        callback(encoder_data_parallel="true"),
        "encoder_data_parallel",
    ),
    ("callback cast_weights_per_run=1", callback(cast_weights_per_run=1), "cast_weights_per_run"),
    ("callback compile=1", callback(compile=1), "compile"),
    ("callback budgets [64.9, 128.7]", callback(budgets={"budgets": [64.9, 128.7]}), "budgets"),
    ("callback True as a budget", callback(budgets={"budgets": [True]}), "budgets"),
    ("callback max_budget=True", callback(budgets={"max_budget": True}), "max_budget"),
    ("callback budgets='pow2'", callback(budgets="pow2"), "budgets"),
    ("callback budgets={'bogus': 1}", callback(budgets={"bogus": 1}), "bogus"),
    ("callback stages='validate'", callback(stages="validate"), "stages"),
    ("callback stages=['fit']", callback(stages=["fit"]), "stages"),
    ("callback stages=[]", callback(stages=[]), "stages must be a non-empty list"),
    ("callback stages=b'predict'", callback(stages=b"predict"), "got stages=b'predict'"),
    (
        "callback stages twice",
        callback(stages=["predict", "test", "predict"]),
        "stages lists predict more than once",
    ),
    ("callback module=123", callback(module=123), "module"),
    ("callback module=''", callback(module=""), "module"),
    ("callback mode='fast'", callback(mode="fast"), "mode"),
    ("callback packing='best'", callback(packing="best"), "packing"),
    ("callback ratio=1", callback(budgets={"ratio": 1}), "ratio"),
    ("callback align=2.5", callback(budgets={"align": 2.5}), "align"),
    ("callback adapter='packd'", callback(adapter="packd"), "adapter"),
    ("callback capture='later'", callback(capture="later"), "capture"),
    ("callback max_items_per_batch=2.0", callback(max_items_per_batch=2.0), "max_items_per_batch"),
    ("callback max_frames_per_batch=0", callback(max_frames_per_batch=0), "max_frames_per_batch"),
    ("callback paths as a list", callback(paths=[("local", {})]), "paths"),
    ("callback paths.local='pow2'", callback(paths={"local": "pow2"}), "paths.local"),
    ("callback unknown option", lambda: CUDAGraphCallback(verfy=True), "verfy"),
    ("config cast_weights_per_run=1", graph_config(cast_weights_per_run=1), "cast_weights_per_run"),
    ("config unknown option", graph_config(bogus=1), "bogus"),
    ("callback plan=3", callback(plan=3), "plan must be a JSON file path or None"),
    ("config plan=''", graph_config(plan=""), "plan must be a JSON file path or None"),
    ("config plan a folder", graph_config(plan="."), "plan must be a JSON file path, not a folder"),
    ("config compile without graphs", graph_config(compile=True, mode="none"), "compile"),
    (
        "config min_budget > max_budget",
        graph_config(budgets={"min_budget": 128, "max_budget": 64}),
        "min_budget",
    ),
    ("BudgetConfig min_budget=-1", lambda: BudgetConfig(min_budget=-1), "min_budget"),
    ("BudgetConfig ratio='1.5'", lambda: BudgetConfig(ratio="1.5"), "ratio"),
    ("BudgetConfig ratio=inf", lambda: BudgetConfig(ratio=float("inf")), "ratio"),
    ("BudgetConfig ratio=nan", lambda: BudgetConfig(ratio=float("nan")), "ratio"),
    ("BudgetConfig pow2 ratio", lambda: BudgetConfig(ratio=1.5), "ratio=1.5 applies only"),
    (
        "config pow2 align uncompiled",
        graph_config(budgets={"align": 10**9}),
        "budgets.align=1000000000 is read only by compiled capture",
    ),
    (
        "BudgetConfig explicit align",
        lambda: BudgetConfig(budgets=[8, 16], align=10**9),
        "align=1000000000 applies only",
    ),
    (
        "BudgetConfig explicit geometric",
        lambda: BudgetConfig(budgets=[8, 16], ladder="geometric"),
        "ladder='geometric' exclude each other",
    ),
    (
        "BudgetConfig explicit min_budget below",
        lambda: BudgetConfig(budgets=[16, 32], min_budget=8),
        "min_budget=8 contradicts budgets=[16, 32]",
    ),
    (
        "BudgetConfig explicit max_budget above",
        lambda: BudgetConfig(budgets=[16, 32], max_budget=64),
        "max_budget=64 contradicts",
    ),
    ("manager max_budget=99999999", manager(budgets={"max_budget": 99999999}), "max_budget"),
    ("manager unknown path name", manager(paths={"glob": {}}), "paths"),
    (
        "graphed geometric align=10**9",
        served(budgets={"ladder": "geometric", "align": 10**9}),
        "budgets.align",
    ),
    (
        "graphed geometric ratio=1e308",
        served(budgets={"ladder": "geometric", "ratio": 1e308}),
        "budgets.ratio",
    ),
    (
        "config geometric ratio=1e308 between given ends",
        graph_config(
            paths={
                "local": {
                    "min_budget": 64,
                    "max_budget": 1024,
                    "ladder": "geometric",
                    "ratio": 1e308,
                }
            }
        ),
        "paths.local.ratio",
    ),
    (
        "manager path budget too large",
        manager(paths={"global": {"budgets": [10**9]}}),
        "paths.global.budgets",
    ),
    (
        "manager cast_weights_per_run='yes'",
        manager(cast_weights_per_run="yes"),
        "cast_weights_per_run",
    ),
    ("manager packing=None", manager(packing=None), "packing"),
    (
        "manager config and options",
        lambda: EncoderGraphManager(tiny_adapter(), GraphConfig(), mode="none"),
        "config",
    ),
    ("manager encoder=object()", lambda: EncoderGraphManager(object()), "encoder"),
]


def message(error: BaseException) -> str:
    """The error's text with its causes (Hydra wraps the checks' errors); without
    Hydra's echo of the override, which would name any field."""
    if isinstance(error, ConfigCompositionException) and error.__cause__ is not None:
        error = error.__cause__
    parts = []
    while error is not None:
        parts.append(str(error))
        error = error.__cause__
    return "\n".join(parts)


def names_field(text: str, field: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(field)}(?!\w)", text) is not None


class WorkStarted(AssertionError):
    """The app got past its checks to the Trainer."""


def test_the_table_covers_at_least_sixty_bad_inputs():
    assert len(HYDRA_ROWS) + len(BENCH_ROWS) + len(PYTHON_ROWS) >= 60 and len(HYDRA_ROWS) >= 30


@pytest.mark.parametrize(
    ("app", "overrides", "field"), HYDRA_ROWS, ids=[" ".join(row[1]) for row in HYDRA_ROWS]
)
def test_a_bad_override_is_refused_before_the_trainer(app, overrides, field, monkeypatch):
    if "model=qwen2_vl_vision" in overrides:
        pytest.importorskip("transformers")

    def no_trainer(*args, **kwargs):
        raise WorkStarted(f"{overrides} reached the Trainer: accepted")

    monkeypatch.setattr(lightning_cg.app.runner, "make_trainer", no_trainer)
    started = time.perf_counter()
    with pytest.raises(REFUSALS) as refused:
        cfg = compose_config(app, ["trainer=cpu", *overrides])
        lightning_cg.app.runner.run(cfg, "fit" if app == "train" else app)
    assert time.perf_counter() - started < FAST_SECONDS
    assert names_field(message(refused.value), field), message(refused.value)


@pytest.mark.parametrize(
    ("call", "field"), [row[1:] for row in PYTHON_ROWS], ids=[row[0] for row in PYTHON_ROWS]
)
def test_a_bad_python_argument_is_refused_at_construction(call, field):
    started = time.perf_counter()
    with pytest.raises(REFUSALS) as refused:
        call()
    assert time.perf_counter() - started < FAST_SECONDS
    assert names_field(message(refused.value), field), message(refused.value)


@pytest.mark.parametrize(("overrides", "field"), BENCH_ROWS, ids=[row[0][0] for row in BENCH_ROWS])
def test_a_bad_bench_override_is_refused_before_any_workload(overrides, field):
    with pytest.raises(REFUSALS) as refused:
        config = compose_config("bench", ["tiny=true", "device=cpu", *overrides])
        resolve_settings(OmegaConf.to_container(config, resolve=True))
    assert names_field(message(refused.value), field), message(refused.value)


def test_every_data_option_checks_the_tower_it_feeds():
    """The apps ask each conf/data option's class whether it fits the model: none is unchecked."""
    for path in (CONF / "data").glob("*.yaml"):
        data_class = get_class(OmegaConf.load(path)["_target_"])
        assert callable(getattr(data_class, "check_model_input", None)), path.name


def test_a_budget_that_fits_and_matching_data_pass_the_checks(monkeypatch):
    """The checks refuse what cannot work only: the same options, sane, reach the Trainer."""

    def no_trainer(*args, **kwargs):
        raise WorkStarted

    monkeypatch.setattr(lightning_cg.app.runner, "make_trainer", no_trainer)
    sane = [
        ["cudagraph.budgets.max_budget=4096", "compare_eager=false"],
        ["model=vit_b_16", "data=fake", "data.image_size=224"],
        ["model=vit_b_16", "data=photos"],
        ["data=synthetic", "data.merge_size=2", "+cudagraph.paths.global.max_budget=1024"],
        [
            "cudagraph.adapter={_target_: lightning_cg.adapters.packed.PackedEncoderAdapter, "
            "_partial_: true}"
        ],
    ]
    for overrides in sane:
        with pytest.raises(WorkStarted):
            config = compose_config("predict", ["trainer=cpu", *overrides])
            lightning_cg.app.runner.run(config, "predict")


@pytest.mark.parametrize(
    ("overrides", "field"),
    [(["cudagraph.compile=maybe"], "compile"), (["model=packed_vit_small", "data=fake"], "data")],
)
def test_the_predict_script_refuses_before_work(overrides, field):
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "predict.py"),
            *overrides,
            "hydra.run.dir=/tmp/lcg-bad",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode != 0
    assert names_field(result.stderr, field), result.stderr[-3000:]
    # Refused by the checks (or Hydra), not deep inside a data module or the Trainer.
    assert "torchvision" not in result.stderr and "lightning-cg predict" not in result.stdout
