"""The manager's ``ladder="auto"``: budgets learned from the first batches."""

import random

import pytest
import torch
from toy_encoder import ToyEncoder, ToyTower

from lightning_cg.core.learned_budgets import choose_budgets, expected_padding
from lightning_cg.engine.manager import BudgetConfig, EncoderGraphManager
from lightning_cg.engine.replay import relative_error


def make_batch(rng: random.Random, lengths: list[int]):
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    return torch.randn(sum(lengths), 8, generator=generator), torch.tensor(lengths)


def run(manager: EncoderGraphManager, tokens: torch.Tensor, lengths: torch.Tensor):
    return manager.execute(manager.encoder.inputs_from_call((tokens, lengths), {}))


def auto_manager(tower: ToyTower, **budget_fields) -> EncoderGraphManager:
    budgets = BudgetConfig(ladder="auto", **budget_fields)
    return EncoderGraphManager(
        ToyEncoder(tower, max_budget=256), budgets=budgets, capture="first_use"
    )


def captured_budgets(manager: EncoderGraphManager, path: str = "local") -> set[int]:
    return {key.descriptor.num_tokens for key in manager.cache.keys() if key.path == path}


def test_auto_ladder_is_learned_from_the_first_batch_before_capture():
    tower = ToyTower().eval()
    manager = auto_manager(tower, k=3, align=8)
    assert list(manager.paths["local"].budgets) == [8, 16, 32, 64, 128, 256]  # pow2 until learned
    tokens, lengths = make_batch(random.Random(0), [40, 30, 100, 7])
    with torch.no_grad():
        assert relative_error(run(manager, tokens, lengths), tower(tokens, lengths)) < 1e-5
    sums = [177]  # 7 + 30 + 40 + 100, one sub-batch
    expected = choose_budgets(sums, 3, 8, 256, align=8)
    assert list(manager.paths["local"].budgets) == expected == [8, 184, 256]
    assert captured_budgets(manager) == {184}  # only the key the batch needed
    learned = manager.learned_budgets["local"]
    assert learned["expected_padding"] == expected_padding(sums, expected)
    assert learned["sampled_sub_batches"] == 1
    assert manager.stats.hits == 1 and manager.stats.padded_tokens == 184 - 177


def test_auto_ladder_samples_several_batches_eagerly_first():
    tower = ToyTower().eval()
    manager = auto_manager(tower, k=4, auto_sample_batches=3)
    rng = random.Random(1)
    with torch.no_grad():
        for lengths in ([20], [50, 40], [33]):
            tokens, lengths = make_batch(rng, lengths)
            assert relative_error(run(manager, tokens, lengths), tower(tokens, lengths)) < 1e-5
            learning = manager.learned_budgets == {}
            assert (not manager.is_captured()) == learning
    assert list(manager.paths["local"].budgets) == choose_budgets([20, 90, 33], 4, 8, 256, align=16)
    assert manager.stats.hits == 1 and manager.stats.misses == 0


def test_explicit_sample_skips_learning_at_run_time():
    manager = auto_manager(ToyTower().eval(), k=2)
    # Sub-batches of 100 and 110 tokens; the global path (off: no tokens) is auto too.
    learned = manager.learn_budgets([[{"local": 100}], [{"local": 60}, {"local": 50}]])
    assert learned == {"local": [112, 256], "global": [1, 8]}
    with torch.no_grad():
        run(manager, *make_batch(random.Random(2), [3]))
    assert list(manager.paths["local"].budgets) == [112, 256]  # not relearned from [3]
    assert captured_budgets(manager) == {112}


def test_learning_again_drops_the_graphs_of_the_old_ladder():
    # min_budget 8: rungs are multiples of gcd(16, 8) = 8.
    manager = auto_manager(ToyTower().eval(), k=2)
    with torch.no_grad():
        run(manager, *make_batch(random.Random(3), [100]))
        assert captured_budgets(manager) == {104}
        manager.learn_budgets([[{"local": 20}]])
        assert not manager.is_captured()
        run(manager, *make_batch(random.Random(4), [20]))
    assert captured_budgets(manager) == {24}


def test_a_call_shape_seen_before_learning_again_gets_a_key_of_the_new_ladder():
    manager = auto_manager(ToyTower().eval(), k=2)
    with torch.no_grad():
        run(manager, *make_batch(random.Random(3), [100]))
        manager.learn_budgets([[{"local": 20}]])
        assert list(manager.paths["local"].budgets) == [24, 256]
        run(manager, *make_batch(random.Random(5), [100]))
    assert captured_budgets(manager) == {256}
    assert manager.stats.hits == 2


def test_only_auto_paths_are_learned():
    tower = ToyTower(global_tokens=4).eval()
    manager = EncoderGraphManager(
        ToyEncoder(tower, max_budget=256),
        budgets=BudgetConfig(ladder="auto", k=2),
        paths={"global": BudgetConfig(budgets=[4, 8, 16])},
        capture="first_use",
    )
    assert manager.learn_budgets([[{"local": 100, "global": 4}]]) == {"local": [104, 256]}
    assert list(manager.paths["global"].budgets) == [4, 8, 16]


def test_without_auto_learning_does_nothing():
    manager = EncoderGraphManager(
        ToyEncoder(ToyTower().eval(), max_budget=256), capture="first_use"
    )
    assert manager.learn_budgets([[{"local": 100}]]) == {}
    assert list(manager.paths["local"].budgets) == [8, 16, 32, 64, 128, 256]


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"ladder": "auto", "k": 0}, "k"),
        ({"ladder": "auto", "k": 2.5}, "k"),
        ({"ladder": "auto", "auto_sample_batches": 0}, "auto_sample_batches"),
        ({"ladder": "auto", "budgets": [64, 128]}, "budgets"),
        ({"ladder": "best"}, "pow2, geometric, auto"),
    ],
)
def test_auto_config_errors_name_the_field(fields, name):
    with pytest.raises(ValueError, match=name):
        BudgetConfig(**fields)


def test_predict_app_learns_the_ladder_through_the_callback():
    from hydra import compose, initialize_config_dir
    from test_app import CONF, SMALL_DATA, TINY_TOWER

    from lightning_cg.app.runner import run as run_app

    overrides = ["cudagraph/budgets=auto", "cudagraph.budgets.k=4", "cudagraph.capture=first_use"]
    overrides.append("compare_eager=true")
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("predict", TINY_TOWER + SMALL_DATA + ["trainer=cpu", *overrides])
    report = run_app(cfg, "predict")
    assert report.stats["items"] == 6 and report.stats["hits"] > 0
    assert report.max_abs_difference < 1e-4
    assert report.stats["host_us_per_replay"] > 0


def test_auto_ladder_caps_items_per_sub_batch_at_what_the_sample_needs():
    tower = ToyTower().eval()
    manager = auto_manager(tower, k=3)
    assert manager.max_items == 8 and manager.paths["local"].max_frames == 8
    rng = random.Random(7)
    with torch.no_grad():
        run(manager, *make_batch(rng, [5, 9, 12]))  # the sample: 3 items in one sub-batch
        assert manager.max_items == 4 == manager.learned_budgets["local"]["max_items"]
        assert {graph.spec.max_frames for graph in manager.cache.graphs()} == {4}
        # A larger batch than the sample packs into more sub-batches, not eager.
        tokens, lengths = make_batch(rng, [3] * 6)
        assert relative_error(run(manager, tokens, lengths), tower(tokens, lengths)) < 1e-5
    assert manager.stats.sub_batches == 1 + 2 and manager.stats.misses == 0


def test_auto_ladder_keeps_the_users_item_cap():
    manager = EncoderGraphManager(
        ToyEncoder(ToyTower().eval(), max_budget=256),
        budgets=BudgetConfig(ladder="auto", k=3),
        max_items_per_batch=8,
        capture="first_use",
    )
    with torch.no_grad():
        run(manager, *make_batch(random.Random(8), [5, 9, 12]))
    assert manager.max_items == 8 and manager.paths["local"].max_frames == 8
