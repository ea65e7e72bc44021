"""CostEstimates: graph and capture cost of keys from their path's measured times."""

import pytest

from lightning_cg.cost_estimates import (
    FIT_PATIENCE,
    PRIOR_CAPTURE_RATIO,
    PRIOR_GRAPH_RATIO,
    CostEstimates,
)
from lightning_cg.key_record import KeyRecord


def record(
    path: str = "local",
    size: int = 1024,
    tokens: int = 512,
    eager_s: float | None = 0.010,
    graph_s: float | None = None,
    capture_s: float | None = None,
) -> KeyRecord:
    """A key sighted once with ``tokens`` real tokens, timed as given."""
    key_record = KeyRecord(path, size, sightings=1, real_tokens=tokens)
    if eager_s is not None:
        key_record.add_eager(eager_s / tokens)
    if graph_s is not None:
        key_record.add_graph(graph_s)
    key_record.capture_seconds = capture_s
    return key_record


def test_a_key_without_anything_measured_gets_the_prior_per_padded_token():
    records = {"a": record(size=1024, tokens=512)}
    costs = CostEstimates(records)
    assert costs.graph_ratio(records["a"]) == pytest.approx(PRIOR_GRAPH_RATIO * 2)
    assert costs.capture_ratio("local") == PRIOR_CAPTURE_RATIO


def test_the_nearest_measured_key_of_the_path_sets_the_cost_per_padded_token():
    records = {
        # Full budgets: graph/eager per padded token 0.2 and 0.6.
        "near": record(size=512, tokens=512, graph_s=0.002),
        "far": record(size=4096, tokens=4096, graph_s=0.006),
        "other path": record(path="global", size=1024, tokens=1024, graph_s=0.0001),
        "new": record(size=1024, tokens=512),
    }
    costs = CostEstimates(records)
    assert costs.graph_ratio(records["new"]) == pytest.approx(0.2 * 2)
    assert costs.graph_ratio(records["near"]) == pytest.approx(0.2)  # its own measure


def test_the_capture_ratio_is_the_median_of_the_paths_captures():
    records = {
        "a": record(capture_s=0.02),
        "b": record(capture_s=0.03),
        "c": record(capture_s=0.10),
        "other path": record(path="global", capture_s=1.0),
    }
    assert CostEstimates(records).capture_ratio("local") == pytest.approx(3.0)


def test_eager_calls_of_several_sizes_set_the_graph_cost_by_their_line():
    records = {"a": record(size=1024, tokens=600, eager_s=0.010)}
    costs = CostEstimates(records)
    for tokens in (64, 1024):
        costs.record_eager_call("local", tokens, 0.009 + 1e-6 * tokens)
    assert costs.graph_ratio(records["a"]) == pytest.approx(1e-6 * 1024 / 0.010)
    costs.graphs_fuse_work = True  # compiled graphs: the line does not bound them
    assert costs.graph_ratio(records["a"]) == pytest.approx(PRIOR_GRAPH_RATIO * 1024 / 600)


def test_the_pessimistic_gain_prices_the_budget_at_the_paths_least_time_per_token():
    records = {"a": record(size=1024, tokens=600, eager_s=0.010)}
    costs = CostEstimates(records)
    costs.record_eager_call("local", 600, 0.010)
    # One size of eager calls: the estimate stands.
    assert costs.pessimistic_gain(records["a"], gain=0.008) == 0.008
    costs.record_eager_call("local", 2000, 0.012)  # 6 us per token, the least
    assert costs.pessimistic_gain(records["a"], gain=0.008) == pytest.approx(0.010 - 6e-6 * 1024)
    assert costs.pessimistic_gain(records["a"], gain=0.001) == 0.001  # never above the estimate
    costs.record_eager_call("local", 100, 0.010)  # 100 us per token cannot raise the cost
    assert costs.pessimistic_gain(records["a"], gain=0.008) == pytest.approx(0.010 - 6e-6 * 1024)


@pytest.mark.parametrize("measured", ["this key", "another key of the path", "fused graphs"])
def test_the_pessimistic_gain_gives_way_to_measured_graphs_and_fused_work(measured):
    records = {"a": record(size=1024, tokens=600, eager_s=0.010)}
    costs = CostEstimates(records)
    for tokens in (600, 2000):
        costs.record_eager_call("local", tokens, 0.012)
    assert costs.pessimistic_gain(records["a"], gain=0.008) < 0.008
    if measured == "this key":
        records["a"].add_graph(0.004)
    elif measured == "another key of the path":
        records["b"] = record(size=2048, tokens=2000, graph_s=0.004)
    else:
        costs.graphs_fuse_work = True
    assert costs.pessimistic_gain(records["a"], gain=0.008) == 0.008


def test_a_path_of_several_sizes_waits_for_its_line_at_most_fit_patience_calls():
    costs = CostEstimates({})
    costs.saw_tokens("local", 100)
    assert not costs.awaiting_eager_line("local")  # one size: no line can come
    costs.saw_tokens("local", 200)
    for _ in range(FIT_PATIENCE):
        assert costs.awaiting_eager_line("local")
        costs.record_eager_call("local", 100, 0.010)  # one size of calls: no line yet
    assert not costs.awaiting_eager_line("local")
