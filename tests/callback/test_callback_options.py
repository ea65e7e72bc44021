"""Each option of CUDAGraphCallback changes what a run does, seen through ``last_stats``,
warnings, errors and outputs of a CPU Trainer (the budget path runs there without capture).

The data: 12 synthetic images of 1 to 20 tokens in three batches of 4, 129 tokens in all.
Options guarded elsewhere: ``stages`` and the sanity check in
test_callback_stages.py, ``encoder_data_parallel`` in test_callback_ddp.py, and ``module``
and ``adapter`` by the errors of test_callback.py.
"""

import functools
import re
import warnings

import pytest
import torch
from test_callback import BUDGETS, datamodule, model, predictions, trainer
from test_find_tower import PlainTower
from torch.utils.data import DataLoader

from lightning_cg.adapters.packed import PackedEncoderAdapter
from lightning_cg.callback.graph_callback import CUDAGraphCallback

SUB_BATCHES = 3  # one per batch of 4 items, unless an option splits them
#: One budget: each sub-batch pads to it; with at most 4 items, few graphs to capture.
ONE_BUDGET = {"budgets": [256]}
FEW_GRAPHS = dict(budgets=ONE_BUDGET, max_items_per_batch=4)


@pytest.fixture(scope="module")
def eager() -> torch.Tensor:
    return predictions()


def graphed_stats(eager: torch.Tensor, **options) -> dict[str, float]:
    """``last_stats`` of a predict run with these options; its outputs must equal eager."""
    callback = CUDAGraphCallback(**options, capture="first_use")
    torch.testing.assert_close(predictions(callback), eager, rtol=1e-5, atol=1e-6)
    return callback.last_stats


def served(stats: dict[str, float]) -> tuple[float, float]:
    return stats["hits"], stats["misses"]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("none", (0, SUB_BATCHES)),
        ("full", (SUB_BATCHES, 0)),
        ("full_uniform_only", (0, SUB_BATCHES)),  # images of mixed sizes
    ],
)
def test_mode_decides_how_sub_batches_run(eager, mode, expected):
    assert served(graphed_stats(eager, mode=mode, **FEW_GRAPHS)) == expected


def test_budgets_set_the_ladder_sub_batches_pad_to(eager):
    stats = graphed_stats(eager, budgets=ONE_BUDGET)
    assert stats["real_tokens"] + stats["padded_tokens"] == SUB_BATCHES * 256


def test_paths_override_the_budgets_of_their_path(eager):
    stats = graphed_stats(eager, budgets=ONE_BUDGET, paths={"local": {"budgets": [128]}})
    assert stats["real_tokens"] + stats["padded_tokens"] == SUB_BATCHES * 128


def test_max_items_per_batch_splits_batches(eager):
    stats = graphed_stats(eager, budgets=BUDGETS, max_items_per_batch=1)
    assert stats["sub_batches"] == stats["hits"] == 12


def test_max_frames_per_batch_sends_sub_batches_of_more_frames_to_eager(eager):
    # Four one-frame images need four attention sequences; the graphs hold one.
    stats = graphed_stats(eager, budgets=BUDGETS, max_frames_per_batch=1)
    assert served(stats) == (0, SUB_BATCHES)


@pytest.mark.parametrize("keep_graphs", [True, False])
def test_keep_graphs_decides_whether_the_next_run_captures_again(keep_graphs, monkeypatch):
    captures = []
    capture_inputs = PackedEncoderAdapter.capture_inputs

    def counted(self, spec):
        captures.append(spec)
        return capture_inputs(self, spec)

    monkeypatch.setattr(PackedEncoderAdapter, "capture_inputs", counted)
    callback = CUDAGraphCallback(budgets=BUDGETS, keep_graphs=keep_graphs, capture="first_use")
    net, run = model(), trainer(callback)
    captured = []
    for _ in range(2):
        run.predict(net, datamodule())
        captured.append(len(captures))
        assert callback.manager.is_captured() == keep_graphs
        # On the CPU no graph is captured: no capture time, whatever the buffers cost.
        assert callback.last_stats["capture_seconds"] == 0
    first, second = captured
    assert first > 0 and (second == first) == keep_graphs


def test_a_graph_forward_that_differs_from_eager_is_caught(eager, monkeypatch):
    graph_forward = PackedEncoderAdapter.graph_forward

    def doubled(self, path, buffers):
        return 2 * graph_forward(self, path, buffers)

    monkeypatch.setattr(PackedEncoderAdapter, "graph_forward", doubled)
    callback = CUDAGraphCallback(budgets=BUDGETS, capture="first_use")
    # The first replay of each graph is checked against eager: the graph's key runs
    # eagerly from then on, with a warning.
    with pytest.warns(UserWarning, match="differs from eager on the same items"):
        predictions(callback)
    assert callback.last_stats["eager_replay_differs"] > 0


def test_compile_replays_a_compiled_graph_forward(eager, monkeypatch):
    # Dynamo's eager backend traces without generating code: fast on any CPU.
    monkeypatch.setattr(
        torch, "compile", functools.partial(_compile_with_eager_backend, torch.compile)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dynamo's notes on the tower
        stats = graphed_stats(eager, **FEW_GRAPHS, compile=True)
    assert stats["compile_seconds"] > 0 and stats["hits"] == SUB_BATCHES


def _compile_with_eager_backend(compile_, function, **options):
    return compile_(function, **{**options, "backend": "eager"})


# (id, the model, callback options, what the refusal says)
OPTIONS_THE_TOWER_WOULD_NOT_USE = [
    (
        "a geometric align past the range",
        model,
        {"budgets": {"ladder": "geometric", "align": 10**9}},
        "budgets.align=1000000000 rounds the first rung of the geometric ladder",
    ),
    (
        "max_frames_per_batch on a batch-first tower",
        PlainTower,
        {"module": "body", "adapter": "batched", "max_frames_per_batch": 2},
        "max_frames_per_batch=2 counts the attention sequences (frames) of a packed tower's",
    ),
]


@pytest.mark.parametrize(
    ("make_model", "options", "refusal"),
    [row[1:] for row in OPTIONS_THE_TOWER_WOULD_NOT_USE],
    ids=[row[0] for row in OPTIONS_THE_TOWER_WOULD_NOT_USE],
)
def test_an_option_the_tower_would_not_use_is_refused_before_any_batch(
    make_model, options, refusal
):
    callback = CUDAGraphCallback(**options)
    net = make_model()
    loader = datamodule() if make_model is model else DataLoader(torch.randn(4, 4), batch_size=2)
    with pytest.raises(ValueError, match=re.escape(refusal)):
        trainer(callback).predict(net, loader)
    assert callback.manager is None and "forward" not in callback._tower.__dict__
