"""graphed(tower): the manager around a tower's forward in a plain PyTorch loop."""

import re
import subprocess
import sys

import pytest
import torch
from torchvision.models import resnet18
from toy_encoder import ToyEncoder, ToyTower

import lightning_cg
from lightning_cg.adapters.batched import BatchedEncoderAdapter
from lightning_cg.engine.config import GraphConfig
from lightning_cg.serve.graphed import graphed


def tiny_resnet() -> torch.nn.Module:
    torch.manual_seed(0)
    return resnet18(num_classes=10).eval()


def toy_call(lengths=(5, 9, 3)) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(sum(lengths), 8), torch.tensor(lengths)


def test_a_resnet_gives_its_eager_output_through_graphs_and_counts_hits():
    tower = tiny_resnet()
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        eager = tower(x)
        with graphed(tower, capture="first_use") as served:
            first = tower(x)
            after_one = served.stats["hits"]
            second = tower(x[:2])
    torch.testing.assert_close(first, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second, eager[:2], rtol=1e-5, atol=1e-5)
    assert after_one > 0 and served.stats["hits"] > after_one
    assert served.stats["items"] == 5
    assert "forward" not in tower.__dict__


def test_a_packed_tower_with_its_own_adapter_gives_its_eager_output():
    torch.manual_seed(0)
    tower = ToyTower(global_tokens=2)
    calls = [toy_call(), toy_call((7, 1)), toy_call((12,))]
    with torch.no_grad():
        eager = [tower(*call) for call in calls]
        # An adapter class is a factory: graphed builds ToyEncoder(tower).
        with graphed(tower, adapter=ToyEncoder, capture="first_use") as served:
            outputs = [tower(*call) for call in calls]
    for output, expected in zip(outputs, eager, strict=True):
        torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)
    assert isinstance(served.manager.encoder, ToyEncoder)
    assert served.stats["hits"] > 0 and served.stats["items"] == 6


def test_the_cpu_captures_no_graph_and_its_stats_say_so():
    # On the CPU, keys "captured" run padded through the graph forward: hits, no graphs.
    torch.manual_seed(0)
    tower = ToyTower(global_tokens=2)
    with torch.no_grad(), graphed(tower, adapter=ToyEncoder, capture="first_use") as served:
        for lengths in ((5, 9, 3), (7, 1), (12,)):
            tower(*toy_call(lengths))
    stats = served.stats
    assert stats["hits"] > 0 and len(served.manager.cache) > 0
    assert (stats["graphs"], stats["graphs_captured"], stats["capture_seconds"]) == (0, 0, 0)


def test_calls_with_grad_enabled_run_eagerly():
    tower = tiny_resnet()
    x = torch.randn(2, 3, 16, 16)
    with graphed(tower, capture="first_use") as served:
        output = tower(x)
    assert output.requires_grad
    assert served.stats["hits"] == 0 and served.stats["items"] == 2


def test_a_tower_in_train_mode_runs_eagerly_and_updates_its_statistics_once():
    # Batch norm in train mode normalises over the batch and updates running statistics:
    # a padded graph would see other rows, and a checked replay would update them twice.
    tower, reference = tiny_resnet().train(), tiny_resnet().train()
    x = torch.randn(3, 3, 16, 16)
    with torch.inference_mode():
        expected = reference(x)
        with graphed(tower, capture="first_use") as served:
            output = tower(x)
    torch.testing.assert_close(output, expected, rtol=0, atol=0)
    for mine, theirs in zip(tower.modules(), reference.modules(), strict=True):
        if isinstance(mine, torch.nn.BatchNorm2d):
            torch.testing.assert_close(mine.running_mean, theirs.running_mean, rtol=0, atol=0)
            assert mine.num_batches_tracked == theirs.num_batches_tracked == 1
    assert served.stats["hits"] == 0 and served.stats["eager_training"] == 1


@pytest.mark.parametrize("raised", [RuntimeError("boom"), KeyboardInterrupt()])
def test_the_forward_comes_back_after_an_exception(raised):
    tower = tiny_resnet()
    with pytest.raises(type(raised)), torch.no_grad(), graphed(tower):
        assert "forward" in tower.__dict__
        tower(torch.randn(1, 3, 16, 16))
        raise raised
    assert "forward" not in tower.__dict__


def test_a_forward_wrapper_set_on_the_instance_is_refused_and_left_in_place():
    # Graphs replay the class's forward: a wrapper that changes the output (accelerate's
    # hooks move and cast) would be bypassed, and the outputs would silently differ.
    tower = tiny_resnet()

    def doubled(x):
        return 2 * type(tower).forward(tower, x)

    tower.forward = doubled
    with pytest.raises(RuntimeError, match="forward is set on the instance.*bypass"):
        with graphed(tower, capture="first_use"):
            pass
    assert tower.__dict__["forward"] is doubled


def test_a_nested_graphed_on_the_same_tower_is_refused():
    tower = tiny_resnet()
    with graphed(tower) as outer:
        patched = tower.__dict__["forward"]
        with pytest.raises(RuntimeError, match="already inside graphed"), graphed(tower):
            pass
        with pytest.raises(RuntimeError, match="already inside graphed"), outer:
            pass
        assert tower.__dict__["forward"] is patched
    assert "forward" not in tower.__dict__


def test_a_bad_option_is_refused_by_graphed_itself():
    tower = tiny_resnet()
    with pytest.raises(ValueError, match="verfy"):
        graphed(tower, verfy=True)
    with pytest.raises(ValueError, match=r"config must be a GraphConfig or None; got config=\{"):
        graphed(tower, config={"mode": "full"})
    assert "forward" not in tower.__dict__


# (id, graphed's arguments besides the tower, error, what the message names)
REFUSED_AT_THE_CALL = [
    (
        "an adapter built on another tower",
        lambda: {"adapter": BatchedEncoderAdapter(tiny_resnet())},
        ValueError,
        "adapter=BatchedEncoderAdapter wraps a ResNet that is not the tower passed to graphed",
    ),
    (
        "a module that is no adapter",
        lambda: {"adapter": torch.nn.Linear(2, 2)},
        ValueError,
        "does not implement GraphableEncoder is a tower, not its adapter); "
        "got adapter=a Linear module",
    ),
    (
        "a named adapter that cannot serve the tower",
        lambda: {"adapter": "packed"},
        TypeError,
        "use adapter='batched'",
    ),
    (
        "max_frames_per_batch on a batch-first tower",
        lambda: {"max_frames_per_batch": 2},
        ValueError,
        "max_frames_per_batch=2 counts the attention sequences",
    ),
]


@pytest.mark.parametrize(
    ("arguments", "error", "named"),
    [row[1:] for row in REFUSED_AT_THE_CALL],
    ids=[row[0] for row in REFUSED_AT_THE_CALL],
)
def test_an_adapter_or_option_that_cannot_serve_the_tower_is_refused_by_the_call(
    arguments, error, named
):
    tower = tiny_resnet()
    with pytest.raises(error, match=re.escape(named)):
        graphed(tower, **arguments())  # no with: refused before it
    assert "forward" not in tower.__dict__


@pytest.mark.parametrize(
    "options",
    [
        {"capture": None},
        {"mode": None, "budgets": None, "compile": None},
        {"cast_weights_per_run": None},
    ],
    ids=["capture", "mode budgets compile", "cast_weights_per_run"],
)
def test_an_option_given_as_none_takes_its_default(options):
    served = graphed(tiny_resnet(), **options)
    with torch.no_grad(), served:
        pass
    assert served.manager.config == GraphConfig()


def test_a_bad_adapter_leaves_the_forward_alone():
    tower = tiny_resnet()
    with pytest.raises(TypeError, match="use adapter='batched'"), graphed(tower, adapter="packed"):
        pass
    assert "forward" not in tower.__dict__


def test_graphed_is_exported_lazily_and_import_stays_torch_free():
    assert lightning_cg.graphed is graphed and "graphed" in lightning_cg.__all__
    check = "import sys, lightning_cg; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", check], check=True)


def test_something_that_is_no_module_is_refused_by_name():
    with pytest.raises(TypeError, match="graphed serves a torch.nn.Module's forward; got function"):
        graphed(lambda images: images)


def test_a_deep_copy_of_a_served_tower_answers_with_its_own_weights():
    import copy

    tower = torch.nn.Linear(6, 5).eval()
    x = torch.randn(3, 6)
    with torch.no_grad(), graphed(tower, adapter="batched", capture="first_use") as served:
        tower(x)
        twin = copy.deepcopy(tower)
        twin.weight.neg_()
        torch.testing.assert_close(twin(x), torch.nn.functional.linear(x, twin.weight, twin.bias))
        # The tower itself is still served by its graphs.
        torch.testing.assert_close(
            tower(x), torch.nn.functional.linear(x, tower.weight, tower.bias)
        )
    assert served.stats["hits"] == 2
    with torch.no_grad():
        torch.testing.assert_close(twin(x), torch.nn.functional.linear(x, twin.weight, twin.bias))
