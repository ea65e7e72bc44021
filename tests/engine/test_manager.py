import random

import pytest
import torch
from toy_encoder import ToyEncoder, ToyTower

import lightning_cg.engine.call_runner
from examples.models.packed_vit import PackedViT, PackedViTConfig, patchify
from lightning_cg.adapters.packed import PackedEncoderAdapter
from lightning_cg.core.dispatcher import GraphMode
from lightning_cg.engine.manager import BudgetConfig, EncoderGraphManager
from lightning_cg.engine.replay import relative_error, replay
from lightning_cg.engine.static_inputs import write_padded, write_padded_array


def make_batch(rng: random.Random, lengths: list[int], dtype=torch.float32, device="cpu"):
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    tokens = torch.randn(sum(lengths), 8, generator=generator).to(device=device, dtype=dtype)
    return tokens, torch.tensor(lengths)


def random_lengths(rng: random.Random, max_budget: int) -> list[int]:
    count = rng.choice([0, 1, 1, 2, 3, 5, 8, 13])
    # Mostly small items, sometimes one larger than every budget.
    return [
        rng.choice([1, 2, 3, 7, 8, 15, 16, 30, max_budget + rng.randrange(1, 9)])
        for _ in range(count)
    ]


def manager_for(tower: ToyTower, per_item_metadata: bool = False, **kwargs) -> EncoderGraphManager:
    encoder = ToyEncoder(tower, max_budget=64, per_item_metadata=per_item_metadata)
    return EncoderGraphManager(encoder, **kwargs, capture="first_use")


def run(manager: EncoderGraphManager, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    return manager.execute(manager.encoder.inputs_from_call((tokens, lengths), {}))


@pytest.mark.parametrize("global_tokens", [0, 4])
@pytest.mark.parametrize(
    ("mode", "per_item_metadata"),
    [("full", False), ("full", True), ("full_uniform_only", True), ("none", False)],
)
def test_replay_equals_eager_on_random_batches(global_tokens, mode, per_item_metadata):
    torch.manual_seed(0)
    rng = random.Random(f"{global_tokens}{mode}{per_item_metadata}")
    tower = ToyTower(global_tokens=global_tokens).eval()
    manager = manager_for(tower, per_item_metadata, mode=mode)
    with torch.no_grad():
        for _ in range(200):
            tokens, lengths = make_batch(rng, random_lengths(rng, 64))
            expected = tower(tokens, lengths)
            actual = run(manager, tokens, lengths)
            assert actual.shape == expected.shape
            assert relative_error(actual, expected) < 1e-5
    if mode == "full":
        assert manager.stats.hits > 0


def test_stats_count_hits_misses_and_padding():
    tower = ToyTower().eval()
    manager = manager_for(tower, mode="full", budgets=BudgetConfig(budgets=[16, 32, 64]))
    rng = random.Random(0)
    with torch.no_grad():
        run(manager, *make_batch(rng, [5, 7]))  # 12 tokens -> budget 16
        run(manager, *make_batch(rng, [70]))  # larger than every budget -> eager
        run(manager, *make_batch(rng, []))  # nothing to do
    stats = manager.stats
    assert (stats.hits, stats.misses) == (1, 1)
    assert (stats.real_tokens, stats.padded_tokens) == (12, 4)
    assert stats.items == 3 and stats.sub_batches == 2
    assert stats.hit_rate == pytest.approx(0.5)
    assert stats.padding_waste == pytest.approx(4 / 12)


def test_max_items_splits_batches_and_keeps_order():
    tower = ToyTower().eval()
    manager = manager_for(tower, budgets=BudgetConfig(budgets=[16, 32, 64]), max_items_per_batch=2)
    rng = random.Random(1)
    tokens, lengths = make_batch(rng, [9, 1, 4, 2, 3])
    with torch.no_grad():
        actual = run(manager, tokens, lengths)
        expected = tower(tokens, lengths)
    assert manager.stats.sub_batches == 3
    assert relative_error(actual, expected) < 1e-5


def test_frames_over_capacity_skip_the_graph():
    tower = ToyTower().eval()
    manager = manager_for(tower, budgets=BudgetConfig(budgets=[64]), max_frames_per_batch=2)
    rng = random.Random(2)
    with torch.no_grad():
        tokens, lengths = make_batch(rng, [3, 3, 3])
        actual = run(manager, tokens, lengths)
        assert (manager.stats.hits, manager.stats.misses) == (0, 1)
        assert relative_error(actual, tower(tokens, lengths)) < 1e-5
        run(manager, *make_batch(rng, [3, 3]))
    assert manager.stats.hits == 1


def test_per_item_metadata_captures_a_graph_per_item_count_sharing_input_buffers():
    manager = manager_for(
        ToyTower().eval(),
        per_item_metadata=True,
        budgets=BudgetConfig(budgets=[8, 32]),
        max_items_per_batch=4,
    )
    capture_every_key(manager, *make_batch(random.Random(6), [3]))
    local = {key.descriptor: graph for key, graph in manager.cache.items() if key.path == "local"}
    assert sorted((key.num_tokens, key.num_items) for key in local) == [
        (budget, count) for budget in (8, 32) for count in (1, 2, 4)
    ]
    for key, graph in local.items():
        assert graph.spec.max_frames == key.num_items
        assert graph.buffers["cu_seqlens"].shape == (key.num_items + 1,)
    for budget in (8, 32):
        tokens = {
            graph.buffers["tokens"].data_ptr()
            for key, graph in local.items()
            if key.num_tokens == budget
        }
        assert len(tokens) == 1  # one input buffer per budget, whatever the item count
    assert len({graph.buffers["tokens"].data_ptr() for graph in local.values()}) == 2


def capture_every_key(manager: EncoderGraphManager, tokens, lengths) -> None:
    """Capture the whole ladder of every path now, for the signature of this batch."""
    inputs = manager.encoder.inputs_from_call((tokens, lengths), {})
    manager.capture(manager.encoder.graph_signature(inputs))


def per_item_count_manager(tower: ToyTower, **kwargs) -> EncoderGraphManager:
    """Graphs per item count (1, 2, 4, 8) at one budget of 32 tokens."""
    return manager_for(
        tower,
        per_item_metadata=True,
        budgets=BudgetConfig(budgets=[32]),
        max_items_per_batch=8,
        **kwargs,
    )


def record_replayed_slots(monkeypatch) -> list[int]:
    """The sequence slots of every graph replayed from now on, in order."""
    replayed = []

    def spy(graph, *args):
        replayed.append(graph.spec.max_frames)
        return replay(graph, *args)

    monkeypatch.setattr(lightning_cg.engine.call_runner, "replay", spy)
    return replayed


def test_a_sub_batch_replays_the_graph_with_the_fewest_slots_that_hold_it(monkeypatch):
    tower = ToyTower().eval()
    manager = per_item_count_manager(tower)
    slots = record_replayed_slots(monkeypatch)
    rng = random.Random(7)
    with torch.no_grad():
        for lengths in ([5], [5, 6], [2, 3, 4], [1, 2, 3, 4, 5], [1] * 8):
            tokens, lengths = make_batch(rng, lengths)
            assert relative_error(run(manager, tokens, lengths), tower(tokens, lengths)) < 1e-5
    assert slots == [1, 2, 4, 8, 8]


def local_slots(manager: EncoderGraphManager) -> dict[int, int]:
    """Item count -> sequence slots of each local FULL graph (one budget)."""
    return {
        key.descriptor.num_items: graph.spec.max_frames
        for key, graph in manager.cache.items()
        if key.path == "local"
    }


def test_graphs_per_item_count_stop_where_max_frames_does():
    tower = ToyTower().eval()
    manager = per_item_count_manager(tower, max_frames_per_batch=3)
    rng = random.Random(9)
    capture_every_key(manager, *make_batch(rng, [1]))
    with torch.no_grad():
        for lengths in ([4, 5, 6], [1, 2, 3, 4]):
            tokens, lengths = make_batch(rng, lengths)
            assert relative_error(run(manager, tokens, lengths), tower(tokens, lengths)) < 1e-5
    # No two graphs of the same slots: the 8-item graph holds the 3 frames allowed.
    assert local_slots(manager) == {1: 1, 2: 2, 8: 3}
    assert (manager.stats.hits, manager.stats.misses) == (1, 1)  # 4 frames do not fit


@pytest.mark.parametrize(
    ("max_items", "max_frames_per_batch", "frames", "slots"),
    [
        (4, None, 2, 2),  # the two-slot graph
        (2, 4, 3, 4),  # more slots than items: the most items' graph holds every frame
    ],
)
def test_an_item_of_several_frames_takes_a_graph_with_enough_slots(
    monkeypatch, max_items, max_frames_per_batch, frames, slots
):
    config = PackedViTConfig(hidden_size=32, depth=1, num_heads=2, patch_size=4, out_hidden_size=16)
    tower = PackedViT(config).eval()
    # One frame per item by default: a video needs more slots than its item count.
    adapter = PackedEncoderAdapter(tower, min_token_budget=4)
    manager = EncoderGraphManager(
        adapter,
        budgets=BudgetConfig(budgets=[32]),
        max_items_per_batch=max_items,
        max_frames_per_batch=max_frames_per_batch,
        capture="first_use",
    )
    replayed = record_replayed_slots(monkeypatch)
    patches, grid_thw = patchify([torch.randn(frames, 3, 16, 16)], config.patch_size)
    with torch.no_grad():
        actual = manager.execute(adapter.inputs_from_call((patches, grid_thw), {}))
        expected = tower(patches, grid_thw)
    assert replayed == [slots] and manager.stats.hits == 1
    assert relative_error(actual, expected) < 1e-5


def test_uniform_only_mode_serves_uniform_batches_only():
    tower = ToyTower().eval()
    manager = manager_for(tower, mode="full_uniform_only", budgets=BudgetConfig(budgets=[16, 32]))
    rng = random.Random(3)
    with torch.no_grad():
        run(manager, *make_batch(rng, [8, 8]))
        assert (manager.stats.hits, manager.stats.misses) == (1, 0)
        run(manager, *make_batch(rng, [8, 3]))
        run(manager, *make_batch(rng, [5, 5, 5]))  # uniform, but 3 items: no uniform graph
    stats = manager.stats
    assert (stats.hits, stats.misses) == (1, 2)
    # Both fit the budgets: counted as the mode's, not as above the budgets.
    assert (stats.eager_no_graph_for_shape, stats.eager_above_budget) == (2, 0)


def test_output_never_aliases_graph_buffers():
    tower = ToyTower().eval()
    manager = manager_for(tower, budgets=BudgetConfig(budgets=[32]))
    rng = random.Random(4)
    with torch.no_grad():
        tokens, lengths = make_batch(rng, [5, 6])
        first = run(manager, tokens, lengths)
        snapshot = first.clone()
        run(manager, *make_batch(rng, [9, 9]))
    assert torch.equal(first, snapshot)
    storages = {
        b.untyped_storage().data_ptr() for g in manager.cache.graphs() for b in g.buffers.values()
    }
    assert first.untyped_storage().data_ptr() not in storages


def test_grad_enabled_runs_eagerly():
    tower = ToyTower()
    manager = manager_for(tower, budgets=BudgetConfig(budgets=[32]))
    tokens, lengths = make_batch(random.Random(5), [4, 4])
    output = run(manager, tokens, lengths)
    output.sum().backward()
    assert tower.embed.weight.grad is not None
    assert not manager.is_captured()
    # Counted, so a caller who forgot no_grad or inference_mode sees why nothing replays.
    assert (manager.stats.hits, manager.stats.misses, manager.stats.eager_grad_enabled) == (0, 1, 1)


def test_a_tower_in_train_mode_runs_eagerly_until_it_is_back_in_eval_mode():
    tower = ToyTower().train()
    manager = manager_for(tower, budgets=BudgetConfig(budgets=[32]))
    tokens, lengths = make_batch(random.Random(6), [4, 4])
    with torch.no_grad():
        run(manager, tokens, lengths)
        assert (manager.stats.hits, manager.stats.eager_training) == (0, 1)
        tower.eval()
        run(manager, tokens, lengths)
    assert (manager.stats.hits, manager.stats.eager_training) == (1, 1)


@pytest.mark.parametrize("inference_mode", [True, False])
def test_buffers_leave_inference_mode_and_runs_stay_in_the_callers(inference_mode, monkeypatch):
    manager = manager_for(ToyTower().eval(), budgets=BudgetConfig(budgets=[32]))
    seen = {"eager_forward": [], "graph_forward": []}
    for runner in seen:
        original = getattr(manager.encoder, runner)

        def spy(*args, runner=runner, original=original):
            seen[runner].append(torch.is_inference_mode_enabled())
            return original(*args)

        monkeypatch.setattr(manager.encoder, runner, spy)
    # One item over the budget runs eagerly, one small item through the graph path.
    tokens, lengths = make_batch(random.Random(6), [40, 4])
    with torch.inference_mode(inference_mode), torch.no_grad():
        for _ in range(2):
            output = run(manager, tokens, lengths)
    assert manager.stats.hits == 2 and manager.stats.misses == 2
    # Graph buffers are ordinary tensors (made outside inference mode), which a
    # replay writes from the caller's mode, the mode its eager runs use too.
    buffers = [buffer for graph in manager.cache.graphs() for buffer in graph.buffers.values()]
    assert buffers and not any(buffer.is_inference() for buffer in buffers)
    # Eager: the item over the budget in each call, and both padded replays' checks.
    assert seen == {"eager_forward": [inference_mode] * 4, "graph_forward": [inference_mode] * 2}
    assert output.is_inference() == inference_mode


class SlightlyOffEncoder(ToyEncoder):
    """Its graph forward is off by one part in a thousand: above float32's tolerance."""

    def graph_forward(self, path, buffers):
        return super().graph_forward(path, buffers) * (1 + 1e-3)


def test_a_float32_replay_off_by_one_part_in_a_thousand_is_served_eagerly():
    tower = ToyTower().eval()
    manager = EncoderGraphManager(
        SlightlyOffEncoder(tower), budgets=BudgetConfig(budgets=[32]), capture="first_use"
    )
    tokens, lengths = make_batch(random.Random(6), [5, 6])
    with torch.no_grad(), pytest.warns(UserWarning, match=r"relative error 1\.0+e-03"):
        replayed = run(manager, tokens, lengths)
    assert relative_error(replayed, tower(tokens, lengths)) == 0
    assert manager.stats.eager_replay_differs == 1 and manager.stats.hits == 0


def test_a_correct_graph_is_checked_at_its_first_replays_of_each_kind_of_padding():
    tower = ToyTower().eval()
    manager = manager_for(tower, budgets=BudgetConfig(budgets=[32]))
    with torch.no_grad():
        for seed in (7, 8):
            run(manager, *make_batch(random.Random(seed), [5, 6]))
    [graph] = manager.cache.graphs()
    assert graph.checks.passed == {frozenset({"tokens", "items"}): 2}
    assert (manager.stats.checked_replays, manager.stats.hits) == (2, 2)


def test_clear_drops_graphs_and_recaptures():
    tower = ToyTower().eval()
    manager = manager_for(tower, budgets=BudgetConfig(budgets=[16, 32]))
    with torch.no_grad():
        run(manager, *make_batch(random.Random(8), [5]))
        assert manager.is_captured()
        manager.clear()
        assert not manager.is_captured() and not manager.is_captured()
        run(manager, *make_batch(random.Random(9), [5]))
    assert manager.is_captured()


def test_bad_configuration_names_the_field():
    tower = ToyTower()
    with pytest.raises(ValueError, match="unknown graph option.*packing"):
        manager_for(tower, packing="min_padding")
    with pytest.raises(ValueError, match="paths names unknown"):
        manager_for(tower, paths={"nope": BudgetConfig()})
    with pytest.raises(ValueError, match="max_frames_per_batch"):
        manager_for(tower, max_frames_per_batch=0)
    with pytest.raises(ValueError, match="mode"):
        manager_for(tower, mode="fastest")
    with pytest.raises(TypeError, match="GraphableEncoder"):
        EncoderGraphManager(object(), capture="first_use")


def test_path_budgets_override_one_path():
    tower = ToyTower(global_tokens=4)
    manager = manager_for(tower, paths={"global": BudgetConfig(budgets=[4, 8])})
    assert list(manager.paths["global"].budgets) == [4, 8]
    assert manager.paths["local"].budgets[-1] == 64


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_replay_equals_eager(dtype):
    torch.manual_seed(0)
    rng = random.Random(str(dtype))
    tower = ToyTower(global_tokens=4).cuda().to(dtype).eval()
    manager = manager_for(tower, mode="full")
    tolerance = 1e-5 if dtype is torch.float32 else 2e-2
    with torch.no_grad():
        for _ in range(200):
            tokens, lengths = make_batch(rng, random_lengths(rng, 64), dtype=dtype, device="cuda")
            expected = tower(tokens, lengths)
            actual = run(manager, tokens, lengths)
            assert relative_error(actual, expected) < tolerance
    assert manager.stats.graphs > 0 and manager.stats.hits > 0
    assert all(g.cuda_graph is not None for g in manager.cache.graphs())


def test_mode_none_never_captures():
    manager = manager_for(ToyTower().eval(), mode=GraphMode.NONE)
    with torch.no_grad():
        run(manager, *make_batch(random.Random(10), [4]))
    assert not manager.is_captured() and manager.stats.misses == 1


def test_default_ladder_starts_at_the_adapters_minimum():
    # Batch-first towers: budgets count items, so batch 1 must get a graph of 1.
    from lightning_cg.adapters.batched import BatchedEncoderAdapter

    manager = EncoderGraphManager(
        BatchedEncoderAdapter(torch.nn.Linear(4, 4), max_batch_size=64), capture="first_use"
    )
    assert list(manager.paths["image"].budgets) == [1, 2, 4, 8, 16, 32, 64]
    assert manager.max_items == 64


def test_host_time_per_replay_is_counted():
    manager = manager_for(ToyTower().eval(), budgets=BudgetConfig(budgets=[16, 64]))
    with torch.no_grad():
        for seed in range(3):
            run(manager, *make_batch(random.Random(seed), [5, 7]))
    stats = manager.stats
    assert stats.hits == 3 and stats.host_seconds > 0
    assert stats.as_dict()["host_us_per_replay"] == pytest.approx(1e6 * stats.host_seconds / 3)
    # The launch is part of the replay's host time (on the CPU: the graph forward).
    assert 0 < stats.launch_seconds < stats.host_seconds
    assert stats.as_dict()["launch_us_per_replay"] == pytest.approx(1e6 * stats.launch_seconds / 3)
    manager.stats.reset_run()
    assert manager.stats.host_us_per_replay == manager.stats.launch_us_per_replay == 0.0


def _padded(rows: torch.Tensor, size: int, rule: str, as_numpy: bool) -> list:
    """``rows`` written by ``write_padded`` into ``size`` rows that held -1."""
    target = torch.full((size, *rows.shape[1:]), -1, dtype=rows.dtype)
    if as_numpy:
        write_padded_array(target.numpy(), rows.numpy(), rule)
    else:
        write_padded(target, rows, rule)
    return target.tolist()


@pytest.mark.parametrize("as_numpy", [False, True], ids=["torch", "numpy"])
def test_host_rows_are_padded_by_the_buffers_rule(as_numpy):
    cu_seqlens = torch.tensor([0, 3, 7], dtype=torch.int32)
    assert _padded(cu_seqlens, 5, "repeat_last", as_numpy) == [0, 3, 7, 7, 7]
    positions = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    assert _padded(positions, 3, "zero", as_numpy) == [[1, 2], [3, 4], [0, 0]]
    assert _padded(positions, 3, "repeat_last", as_numpy) == [[1, 2], [3, 4], [3, 4]]
    assert _padded(positions, 2, "zero", as_numpy) == positions.tolist()
    # Nothing to repeat: zeros.
    assert _padded(cu_seqlens[:0], 2, "repeat_last", as_numpy) == [0, 0]


def test_a_sub_batch_of_every_item_in_order_is_not_gathered(monkeypatch):
    manager = manager_for(
        ToyTower().eval(), budgets=BudgetConfig(budgets=[16, 64]), max_items_per_batch=2
    )
    gathered = []
    select_items = manager.encoder.select_items
    monkeypatch.setattr(
        manager.encoder,
        "select_items",
        lambda inputs, indices: gathered.append(list(indices)) or select_items(inputs, indices),
    )
    rng = random.Random(11)
    with torch.no_grad():
        tokens, lengths = make_batch(rng, [5, 7])
        torch.testing.assert_close(
            run(manager, tokens, lengths), manager.encoder.tower(tokens, lengths)
        )
        assert gathered == []
        tokens, lengths = make_batch(rng, [5, 7, 3])  # two sub-batches of at most 2 items
        torch.testing.assert_close(
            run(manager, tokens, lengths), manager.encoder.tower(tokens, lengths)
        )
    assert len(gathered) == 2 and sorted(sum(gathered, [])) == [0, 1, 2]


def check_packed_outputs_survive_later_replays(adapter_class: type, device: str) -> None:
    # Two images in packing order that fill the budget: the packed adapter then
    # returns a view of the rows the manager hands it, so only the manager's
    # clone keeps them off the graph's output.
    torch.manual_seed(0)
    config = PackedViTConfig(hidden_size=32, depth=1, num_heads=2, patch_size=4, out_hidden_size=16)
    tower = PackedViT(config).to(device).eval()
    adapter = adapter_class(tower, min_token_budget=4)
    manager = EncoderGraphManager(
        adapter, budgets=BudgetConfig(budgets=[32]), max_items_per_batch=2, capture="first_use"
    )

    def call(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        # 8 + 24 tokens: the budget's 32.
        images = [
            torch.randn(3, 16, 32, generator=generator),
            torch.randn(3, 32, 48, generator=generator),
        ]
        patches, grid_thw = patchify(images, config.patch_size)
        return patches.to(device), grid_thw.to(device)

    with torch.no_grad():
        first_call = call(0)
        first = manager.execute(adapter.inputs_from_call(first_call, {}))
        snapshot = first.clone()
        for seed in (1, 2):  # the same graph, other inputs
            manager.execute(adapter.inputs_from_call(call(seed), {}))
        expected = tower(*first_call)
    assert manager.stats.hits == 3 and manager.stats.padded_tokens == 0
    assert torch.equal(first, snapshot)
    assert relative_error(first, expected) < 1e-4


class StaticOutputAdapter(PackedEncoderAdapter):
    """Returns each graph forward's rows in one output tensor per input buffer, as the
    replay of a CUDA graph does: the next run overwrites them."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.outputs: dict[tuple, torch.Tensor] = {}

    def graph_forward(self, path, buffers):
        rows = super().graph_forward(path, buffers)
        key = (path, buffers["pixel_patches"].data_ptr(), tuple(rows.shape))
        return self.outputs.setdefault(key, torch.empty_like(rows)).copy_(rows)


def test_packed_outputs_survive_later_runs_of_a_static_output():
    check_packed_outputs_survive_later_replays(StaticOutputAdapter, "cpu")


@pytest.mark.cuda
def test_cuda_packed_outputs_survive_later_replays():
    check_packed_outputs_survive_later_replays(PackedEncoderAdapter, "cuda")


def test_path_budgets_set_the_padding_of_their_path_only():
    tower = ToyTower(global_tokens=4).eval()
    tokens, lengths = make_batch(random.Random(13), [5, 6])  # local 11 tokens, global 8
    padded = []
    for path_budgets in (None, {"global": BudgetConfig(budgets=[32])}):
        manager = manager_for(tower, budgets=BudgetConfig(budgets=[16, 64]), paths=path_budgets)
        with torch.no_grad():
            assert relative_error(run(manager, tokens, lengths), tower(tokens, lengths)) < 1e-5
        padded.append(manager.stats.padded_tokens)
    # local 11 -> 16 both times; global 8 -> 16, then -> 32.
    assert padded == [5 + 8, 5 + 24]


def test_progress_is_told_of_every_capture_largest_budget_first():
    told = []
    manager = manager_for(
        ToyTower().eval(),
        budgets=BudgetConfig(budgets=[16, 32]),
        progress=lambda done, total, spec: told.append((done, total, spec.path, spec.token_budget)),
    )
    with torch.no_grad():
        run(manager, *make_batch(random.Random(14), [5]))  # captures the key of budget 16
        run(manager, *make_batch(random.Random(15), [6]))  # captured already: not told again
    assert told == [(1, 1, "local", 16)]
    told.clear()
    capture_every_key(manager, *make_batch(random.Random(16), [5]))  # the whole ladder
    # Largest budget first; local 16 was captured before.
    assert [budget for *_, budget in told] == sorted((budget for *_, budget in told), reverse=True)
    assert [(path, budget) for *_, path, budget in told if path == "local"] == [("local", 32)]


@pytest.mark.parametrize(("budgets", "padded"), [([64], 64 - 12), ([12, 64], 0)])
def test_budgets_set_the_budget_a_sub_batch_pads_to(budgets, padded):
    # 12 tokens: the adapter's default ladder (8 to 64) would pad them to 16.
    tower = ToyTower().eval()
    manager = manager_for(tower, budgets=BudgetConfig(budgets=budgets))
    tokens, lengths = make_batch(random.Random(16), [5, 7])
    with torch.no_grad():
        assert relative_error(run(manager, tokens, lengths), tower(tokens, lengths)) < 1e-5
    assert (manager.stats.hits, manager.stats.padded_tokens) == (1, padded)


@pytest.mark.parametrize("mode", ["none", "full"])
def test_eager_runs_keep_the_callers_no_grad(mode):
    # A Trainer's validation may run under no_grad rather than inference mode:
    # eager sub-batches must not turn grad back on (autograd graphs, saved
    # activations) nor hand back inference tensors the caller cannot use later.
    tower = ToyTower().eval()
    grad_in_forward = []
    tower.embed.register_forward_pre_hook(
        lambda module, args: grad_in_forward.append(torch.is_grad_enabled())
    )
    manager = manager_for(tower, mode=mode, budgets=BudgetConfig(budgets=[16]))
    rng = random.Random(0)
    with torch.no_grad():
        outputs = [run(manager, *make_batch(rng, lengths)) for lengths in ([70], [5, 7], [3])]
    assert grad_in_forward and not any(grad_in_forward)
    for output in outputs:
        assert not output.requires_grad and not output.is_inference()
