import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from toy_encoder import ToyEncoder, ToyTower

from lightning_cg import measured
from lightning_cg.cache import CapturedGraph, GraphCache, GraphSet
from lightning_cg.manager import BudgetConfig, EncoderGraphManager
from lightning_cg.measured import DecisionTable, check_dispatch, fill_budget
from lightning_cg.replay import relative_error

#: A small tower: launches dominate, so graphs win below ~700 tokens, then lose.
GRAPH_MS = {64: 0.5, 256: 0.8, 1024: 6.0, 4096: 30.0}
EAGER_MS = [(64, 3.0), (256, 3.2), (1024, 5.0), (4096, 20.0)]


def table() -> DecisionTable:
    return DecisionTable(GRAPH_MS, EAGER_MS)


def test_eager_cost_interpolates_and_extrapolates():
    costs = table()
    assert costs.eager_cost(64) == 3.0
    assert costs.eager_cost(10) == 3.0  # held at the first measurement
    assert costs.eager_cost(640) == pytest.approx(3.2 + 1.8 * 384 / 768)
    assert costs.eager_cost(8192) == pytest.approx(20.0 + 15.0 * 4096 / 3072)


def test_eager_cost_never_falls_with_more_tokens():
    noisy = DecisionTable({64: 1.0}, [(64, 2.0), (128, 1.5), (256, 4.0)])
    assert noisy.eager_cost(128) == 2.0
    assert noisy.eager_cost(96) == 2.0


def test_picks_graph_where_it_wins():
    decision = table().choose([100, 50])
    assert (decision.runner, decision.budget, decision.cost_ms) == ("graph", 256, 0.8)


def test_picks_eager_where_the_graph_loses():
    # 900 tokens pad to 1024: 6 ms against about 4.6 ms eager.
    decision = table().choose([900])
    assert decision.runner == "eager" and decision.budget is None
    assert decision.cost_ms == pytest.approx(table().eager_cost(900))


def test_picks_a_split_where_cheaper():
    # A GPU-bound tower: 1100 tokens pad to 4096 (16 ms) or run eagerly (~5.4 ms);
    # graphs of 256 (the 100-token item) and 1024 (the 1000-token one) cost 5 ms.
    costs = DecisionTable(
        {256: 1.0, 1024: 4.0, 4096: 16.0}, [(256, 2.0), (1024, 5.0), (4096, 20.0)]
    )
    decision = costs.choose([1000, 100])
    assert decision.runner == "split"
    assert decision.parts == ((1,), (0,))
    assert decision.cost_ms == 5.0 < costs.eager_cost(1100)


def test_eager_wins_ties():
    assert DecisionTable({64: 1.0}, [(64, 1.0)]).choose([64]).runner == "eager"


def test_above_every_budget_runs_eagerly():
    assert table().choose([5000]).runner == "eager"


def test_rows_say_where_each_graph_wins():
    rows = {row["budget"]: row for row in table().rows()}
    assert rows[64]["graph_wins_from"] == 1
    assert rows[256]["graph_wins_from"] == 65
    assert rows[1024]["graph_wins_from"] is None  # eager at 1024 is 5 ms < 6 ms
    assert rows[4096]["graph_wins_from"] is None
    assert rows[256]["graph_ms"] == 0.8 and rows[256]["eager_ms"] == 3.2


@given(
    graph=st.lists(st.floats(0.01, 50), min_size=4, max_size=4),
    eager=st.lists(st.floats(0.01, 50), min_size=4, max_size=4),
    items=st.lists(st.integers(1, 1500), min_size=1, max_size=6),
)
def test_choice_is_never_worse_than_graph_or_eager(graph, eager, items):
    costs = DecisionTable(
        dict(zip(GRAPH_MS, graph, strict=True)),
        list(zip([64, 256, 1024, 4096], eager, strict=True)),
    )
    decision = costs.choose(items)
    total = sum(items)
    assert decision.cost_ms <= costs.eager_cost(total)
    if decision.runner == "graph":
        assert costs.graph_ms[decision.budget] < costs.eager_cost(total)
    fitting = [b for b in costs.budgets if b >= total]
    if fitting:
        assert decision.cost_ms <= costs.graph_ms[fitting[0]]
    if decision.runner == "split":
        assert sorted(i for part in decision.parts for i in part) == list(range(len(items)))
        assert len(decision.parts) >= 2
        # Each part keeps the sub-batch's order, so consecutive items stay a view.
        assert all(list(part) == sorted(part) for part in decision.parts)


@pytest.mark.parametrize(
    ("graph_ms", "eager_ms", "field"),
    [
        ({}, [(64, 1.0)], "graph_ms"),
        ({0: 1.0}, [(64, 1.0)], "graph_ms"),
        ({64: -1.0}, [(64, 1.0)], "graph_ms"),
        ({64: 1.0}, [], "eager_ms"),
        ({64: 1.0}, [(0, 1.0)], "eager_ms"),
    ],
)
def test_table_errors_name_the_field(graph_ms, eager_ms, field):
    with pytest.raises(ValueError, match=field):
        DecisionTable(graph_ms, eager_ms)


def test_unknown_dispatch_names_the_field_and_allowed_values():
    assert check_dispatch("measured") == "measured"
    with pytest.raises(
        ValueError, match=r"dispatch must be one of budget, measured; got 'fastest'"
    ):
        check_dispatch("fastest")
    with pytest.raises(ValueError, match=r"dispatch must be one of budget, measured"):
        EncoderGraphManager(ToyEncoder(ToyTower()), dispatch="fastest", capture="first_use")


@pytest.mark.parametrize(
    ("tokens", "frames", "budget", "max_items", "max_frames", "expected"),
    [
        ([3, 5], [1, 1], 12, 8, 8, [0, 1, 0]),  # repeats in turn while they fit
        ([5, 3], [1, 1], 12, 8, 8, [1, 0, 1]),  # smallest first, in any order
        ([3, 5], [1, 1], 16, 8, 8, [0, 1, 0, 1]),
        ([3, 5], [1, 1], 100, 3, 8, [0, 1, 0]),  # max_items
        ([3, 5], [2, 2], 100, 8, 5, [0, 1]),  # max_frames
        ([9, 4, 0], [1, 1, 1], 8, 8, 8, [1, 1]),  # too large and empty items skipped
        ([9], [1], 8, 8, 8, []),
    ],
)
def test_fill_budget_repeats_real_items_within_every_limit(
    tokens, frames, budget, max_items, max_frames, expected
):
    assert fill_budget(tokens, frames, budget, max_items, max_frames) == expected


# ------------------------------------------------------------ in the manager


def make_batch(rng: random.Random, lengths: list[int], device="cpu", dtype=torch.float32):
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    tokens = torch.randn(sum(lengths), 8, generator=generator).to(device=device, dtype=dtype)
    return tokens, torch.tensor(lengths)


def run(manager: EncoderGraphManager, tokens: torch.Tensor, lengths: torch.Tensor):
    return manager.execute(manager.encoder.inputs_from_call((tokens, lengths), {}))


def measured_manager(table: DecisionTable) -> EncoderGraphManager:
    """A CPU manager whose local path follows ``table``, as if it had been measured."""
    manager = EncoderGraphManager(
        ToyEncoder(ToyTower().eval()),
        dispatch="measured",
        budgets=BudgetConfig(budgets=[16, 32, 64]),
        capture="first_use",
    )
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="dispatch='measured'.*no CUDA"):
        run(manager, *make_batch(random.Random(0), [4]))
    manager.measured.set_table(GraphSet((torch.float32, torch.device("cpu"))), "local", table)
    manager.reset_stats()
    return manager


def test_table_is_timed_on_the_first_real_items_repeated(monkeypatch):
    # CUDA timing stood in for: each timed run is executed once; a graph replay
    # costs 1 ms, eager a ms per real row it returns.
    manager = EncoderGraphManager(
        ToyEncoder(ToyTower().eval()),
        dispatch="measured",
        budgets=BudgetConfig(budgets=[8, 16, 32, 64]),
        capture="first_use",
    )
    timed = []

    def fake_time_ms(run, repeats=10, warmup=3):
        rows = run().shape[0]
        # A graph's timed replay is the manager's replay of that graph.
        is_replay = isinstance(getattr(run, "args", (None,))[0], CapturedGraph)
        timed.append(("graph" if is_replay else "eager", rows))
        return 1.0 if is_replay else float(rows)

    monkeypatch.setattr(measured, "time_ms", fake_time_ms)
    tower = manager.encoder.tower
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="no CUDA"):
        run(manager, *make_batch(random.Random(9), [3]))  # captures; cannot time on the CPU
    # As if captured on CUDA: lets the timing run; the CPU path needs no pool.
    monkeypatch.setattr(GraphCache, "has_pool", property(lambda cache: True))
    with torch.no_grad():
        tokens, lengths = make_batch(random.Random(10), [10, 7])
        assert relative_error(run(manager, tokens, lengths), tower(tokens, lengths)) < 1e-5
    (table,) = manager.measured.tables.values()
    assert table.budgets == [8, 16, 32, 64]
    # The sub-batch packs as [7, 10]; each budget takes them in turn while they fit.
    expected = [7, 7 + 7, 7 + 10 + 7 + 7, 3 * (7 + 10) + 7]
    assert [tokens for tokens, _ in table.eager_points] == expected
    # Graph and eager each ran once per budget, on the same items.
    assert sorted(timed) == sorted(
        [("graph", t) for t in expected] + [("eager", t) for t in expected]
    )
    assert table.graph_ms == {8: 1.0, 16: 1.0, 32: 1.0, 64: 1.0}


def test_measured_dispatch_without_cuda_warns_once_and_uses_budgets():
    manager = EncoderGraphManager(
        ToyEncoder(ToyTower().eval()), dispatch="measured", capture="first_use"
    )
    with torch.no_grad():
        with pytest.warns(RuntimeWarning, match="dispatch='measured'"):
            run(manager, *make_batch(random.Random(1), [4]))
        run(manager, *make_batch(random.Random(2), [5]))  # no second warning (-W error)
    assert manager.stats.hits == 2 and manager.decision_table() == []


def test_manager_runs_eagerly_where_the_table_says_the_graph_loses():
    # Graphs win at 16 and 64 tokens, lose at 32.
    manager = measured_manager(DecisionTable({16: 1.0, 32: 9.0, 64: 2.0}, [(16, 5.0), (64, 5.0)]))
    tower = manager.encoder.tower
    rng = random.Random(3)
    with torch.no_grad():
        for lengths, hits, eager in (([10], 1, 0), ([20, 5], 1, 1), ([60], 2, 1)):
            tokens, lengths = make_batch(rng, lengths)
            assert relative_error(run(manager, tokens, lengths), tower(tokens, lengths)) < 1e-5
            assert (manager.stats.hits, manager.stats.measured_eager) == (hits, eager)
    assert manager.stats.misses == 1


def test_manager_splits_where_the_table_says_so():
    # 40 tokens would pad to 64 at 20 ms; two graphs of 32 (30 and 10 tokens) cost 2 ms.
    manager = measured_manager(DecisionTable({16: 1.0, 32: 1.0, 64: 20.0}, [(16, 30.0)]))
    tower = manager.encoder.tower
    tokens, lengths = make_batch(random.Random(4), [30, 10])
    with torch.no_grad():
        assert relative_error(run(manager, tokens, lengths), tower(tokens, lengths)) < 1e-5
    stats = manager.stats
    assert (stats.measured_splits, stats.hits, stats.misses) == (1, 2, 0)
    assert stats.real_tokens == 40 and stats.padded_tokens == 2 + 6


def test_decision_table_rows_name_path_and_budget():
    manager = measured_manager(DecisionTable({16: 1.0, 32: 9.0, 64: 2.0}, [(16, 5.0), (64, 5.0)]))
    rows = manager.decision_table()
    assert [(row["path"], row["budget"]) for row in rows] == [("local", b) for b in (16, 32, 64)]
    assert rows[1]["graph_wins_from"] is None and rows[0]["graph_wins_from"] == 1


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_measured_dispatch_never_replays_a_graph_its_table_says_loses(dtype, monkeypatch):
    torch.manual_seed(0)
    tower = ToyTower(global_tokens=4).cuda().to(dtype).eval()
    manager = EncoderGraphManager(
        ToyEncoder(tower, max_budget=256), dispatch="measured", capture="first_use"
    )
    replayed = []  # (path, budget) of each dispatched replay of the current call
    cuda_replay = torch.cuda.CUDAGraph.replay

    def observe(cuda_graph):
        # Replays timed while a table is being measured are not dispatched.
        measured_paths = {path for _, path in manager.measured.tables}
        for key, graph in manager.cache.items():
            if graph.cuda_graph is cuda_graph and key.path in measured_paths:
                replayed.append((key.path, graph.spec.token_budget))
        return cuda_replay(cuda_graph)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", observe)
    rng = random.Random(str(dtype))
    tolerance = 1e-5 if dtype is torch.float32 else 2e-2
    dispatched = []  # per call: its replays and the real tokens its replays served
    with torch.no_grad():
        for _ in range(100):
            lengths = [rng.randrange(1, 120) for _ in range(rng.randrange(1, 6))]
            tokens, lengths = make_batch(rng, lengths, device="cuda", dtype=dtype)
            replayed.clear()
            served_before = manager.stats.real_tokens
            assert relative_error(run(manager, tokens, lengths), tower(tokens, lengths)) < tolerance
            dispatched.append((list(replayed), manager.stats.real_tokens - served_before))
    tables = {path: table for (_, path), table in manager.measured.tables.items()}
    assert set(tables) == {"local", "global"}
    wins_from = {
        (row["path"], row["budget"]): row["graph_wins_from"] for row in manager.decision_table()
    }
    replays = [replay for call, _ in dispatched for replay in call]
    assert replays, "measured dispatch replayed no graph"
    for call, served in dispatched:
        # A graph is replayed only where its table says it wins: from its
        # break-even token count up to its budget, and never where it always loses.
        assert all(wins_from[replay] is not None for replay in call), call
        assert served >= sum(wins_from[replay] for replay in call), (call, served)
    assert manager.stats.hits >= len(replays)


@pytest.mark.cuda
def test_cuda_table_times_eager_on_the_real_items_repeated():
    tower = ToyTower().cuda().eval()
    manager = EncoderGraphManager(
        ToyEncoder(tower, max_budget=256), dispatch="measured", capture="first_use"
    )
    with torch.no_grad():
        run(manager, *make_batch(random.Random(5), [10, 7], device="cuda"))
    (table,) = manager.measured.tables.values()
    # Every budget is filled with copies of the 10- and 7-token items, not with
    # one sequence of the budget's size (8, 16, 32, ... tokens).
    for tokens, _ in table.eager_points:
        assert any((tokens - 10 * tens) % 7 == 0 for tens in range(tokens // 10 + 1)), tokens
    assert max(tokens for tokens, _ in table.eager_points) > 17
