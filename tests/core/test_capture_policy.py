"""CapturePolicy: which keys are captured when, from scripted timings, and through the manager."""

import time

import pytest
import torch
from toy_encoder import ToyEncoder, ToyTower

from lightning_cg.core.capture_policy import (
    CAPTURE,
    FIRST_CAPTURE_FACTOR,
    MIN_SIGHTINGS,
    NO_GAIN,
    PRIOR_CAPTURE_RATIO,
    PRIOR_GRAPH_RATIO,
    SAMPLES,
    WAIT,
    CapturePolicy,
)
from lightning_cg.engine.manager import EncoderGraphManager


def policy_for(expected_calls: int | None, captured_before: bool = True, **options):
    """A policy whose tower has (or has not yet) had a graph captured."""
    policy = CapturePolicy(**options)
    if captured_before:
        policy.record_capture("an earlier key", 0.0)
    policy.begin_run(expected_calls=expected_calls)
    return policy


def see(
    policy: CapturePolicy,
    key: str,
    eager_s: float | None = None,
    size: int = 64,
    tokens: int | None = None,
) -> str:
    """One call whose only sub-batch needs ``key`` (``tokens`` real tokens, by
    default all ``size``); returns the policy's decision."""
    tokens = size if tokens is None else tokens
    policy.called()
    policy.sighted(key, path="local", size=size, tokens=tokens)
    if eager_s is not None and policy.wants_eager_timing(key):
        policy.record_eager(key, eager_s, tokens)
    return policy.decide(key)


def first_capture(decisions: list[str]) -> int | None:
    return decisions.index(CAPTURE) if CAPTURE in decisions else None


def test_first_use_captures_at_the_first_sighting():
    policy = CapturePolicy(first_use=True)
    policy.begin_run(expected_calls=None)
    assert see(policy, "a") == CAPTURE


def test_a_key_waits_for_its_second_sighting_and_a_timing():
    assert MIN_SIGHTINGS == 2
    policy = policy_for(expected_calls=1000)
    assert see(policy, "a", eager_s=0.01) == WAIT  # seen once
    assert see(policy, "a") == CAPTURE  # seen twice, ample calls left
    untimed = policy_for(expected_calls=1000)
    see(untimed, "b")
    assert see(untimed, "b") == WAIT  # no eager time measured yet


def test_a_run_of_known_length_captures_once_its_remaining_calls_repay_the_capture():
    # Prior: a capture costs 5 eager runs, a replay saves half an eager run: it
    # pays after 10 replays. At the second sighting of a run of n calls, n - 2 remain.
    assert PRIOR_CAPTURE_RATIO / (1 - PRIOR_GRAPH_RATIO) == 10
    short = policy_for(expected_calls=11)
    assert [see(short, "a", eager_s=0.01) for _ in range(2)] == [WAIT, WAIT]
    long = policy_for(expected_calls=12)
    assert [see(long, "a", eager_s=0.01) for _ in range(2)] == [WAIT, CAPTURE]


def test_the_first_capture_of_a_tower_is_expected_to_cost_more():
    # 2 x 5 eager runs: at the second sighting a run of 21 calls has 19 left, each
    # saving half an eager run (9.5 < 10); one of 22 has 20 (10 >= 10).
    assert FIRST_CAPTURE_FACTOR == 2
    short = policy_for(expected_calls=21, captured_before=False)
    see(short, "a", eager_s=0.01)
    assert short.estimates("a")["capture_s"] == pytest.approx(0.01 * 5 * 2)
    assert see(short, "a") == WAIT
    long = policy_for(expected_calls=22, captured_before=False)
    see(long, "a", eager_s=0.01)
    assert see(long, "a") == CAPTURE


def test_measured_captures_replace_the_prior_but_a_towers_first_capture_teaches_nothing():
    policy = CapturePolicy()
    policy.begin_run(expected_calls=100)
    for key in ("first", "second", "third"):
        see(policy, key, eager_s=0.010)
    policy.record_capture("first", 0.5)  # the kernels' set-up: 50 eager runs
    assert policy.estimates("third")["capture_s"] == pytest.approx(0.010 * PRIOR_CAPTURE_RATIO)
    # A key's own measured capture is its estimate, the first one's too.
    assert policy.estimates("first")["capture_s"] == pytest.approx(0.5)
    policy.record_capture("second", 0.020)  # 2 eager runs
    assert policy.estimates("third")["capture_s"] == pytest.approx(0.020)


def test_unknown_length_captures_once_the_eager_time_spent_reaches_the_capture_cost():
    # Ski rental: 5 eager runs of 10 ms buy a capture; the sighting after the
    # fifth timed one (its eager time counts from the second sighting on) captures.
    policy = policy_for(expected_calls=None)
    decisions = [see(policy, "a", eager_s=0.01) for _ in range(8)]
    assert first_capture(decisions) == 5
    assert policy.estimates("a")["eager_spent_s"] == pytest.approx(0.01 * 7)


def test_short_runs_that_repeat_capture_their_recurring_keys_at_a_runs_start():
    # Runs of 4 calls never repay a capture alone, but the eager time they
    # spend adds up: 30 ms after one run, 70 ms after two, against a 50 ms
    # capture. A run of known length counts only the earlier runs' time, so
    # the key is captured at the first sighting of the third run, not late in
    # the second (which could not repay it).
    policy = policy_for(expected_calls=4)
    decisions = []
    for _ in range(3):
        policy.begin_run(expected_calls=4)
        decisions.append([see(policy, "a", eager_s=0.01) for _ in range(4)])
    assert decisions[0] == decisions[1] == [WAIT] * 4
    assert decisions[2][0] == CAPTURE


def test_a_run_of_unknown_length_captures_once_the_spent_time_reaches_the_cost_mid_run():
    # The same key and timings, but runs of unknown length: ski rental within
    # the run, at the sighting that brings the time spent to the cost.
    policy = policy_for(expected_calls=None)
    decisions = []
    for _ in range(2):
        policy.begin_run(expected_calls=None)
        decisions.append([see(policy, "a", eager_s=0.01) for _ in range(4)])
    assert decisions[0] == [WAIT] * 4
    assert decisions[1] == [WAIT, CAPTURE, CAPTURE, CAPTURE]


@pytest.mark.parametrize(
    "batches, capture_run, calls", [(48, 1, [0, 1, 2, 3]), (100, 0, [4, 5, 6, 7])]
)
def test_multi_scale_validation_captures_every_resolution_by_the_second_run(
    batches, capture_run, calls
):
    # Four resolutions cycling, three runs of one Trainer; the tower has not
    # been captured before (its first capture costs 2 x 5 eager runs). A run of
    # 100 repays the captures within itself: each side is captured at its second
    # sighting. One of 48 does not, and no run captures late in itself: every
    # side is captured at its first sighting of the run whose start finds enough
    # eager time spent on it.
    policy = policy_for(expected_calls=batches, captured_before=False)
    captured: dict[str, int] = {}
    captured_at_call: dict[str, int] = {}
    for run in range(3):
        policy.begin_run(expected_calls=batches)
        for call in range(batches):
            key = f"side_{call % 4}"
            if key in captured:
                policy.called()
                policy.sighted(key, "local", 16, 16)
                continue
            if see(policy, key, eager_s=0.006, size=16) == CAPTURE:
                captured[key] = run
                captured_at_call[key] = call
                policy.record_capture(key, 0.2 if not captured or len(captured) == 1 else 0.02)
    assert captured == {f"side_{side}": capture_run for side in range(4)}
    assert sorted(captured_at_call.values()) == calls


@pytest.mark.parametrize("later_runs, captured_at", [(None, None), (0, None), (1, 1)])
def test_runs_known_to_follow_repay_a_capture(later_runs, captured_at):
    # A run of 8 alone does not repay a capture (6 x 0.005 s < 0.05 s); with a
    # run known to follow (a fit's next validation run) it does (14 x 0.005 s).
    policy = policy_for(expected_calls=None)
    policy.begin_run(expected_calls=8, later_runs=later_runs)
    decisions = [see(policy, "a", eager_s=0.01) for _ in range(4)]
    assert first_capture(decisions) == captured_at


def test_a_rare_key_among_frequent_ones_waits():
    policy = policy_for(expected_calls=40)
    for call in range(20):
        policy.called()
        policy.sighted("common", "local", 64, 64)
        if call % 10 == 0:
            policy.sighted("rare", "local", 64, 64)
        for key in ("common", "rare"):
            if policy.wants_eager_timing(key):
                policy.record_eager(key, 0.01, 64)
    # common: 20 calls left x 1 per call x 0.005 s = 0.1 s >= 0.05 s
    assert policy.decide("common") == CAPTURE
    # rare: 2 in 20 calls, 2 more expected x 0.005 s, 0.01 s spent < 0.05 s
    assert policy.decide("rare") == WAIT


def test_a_measured_graph_replaces_the_prior_per_padded_token():
    policy = policy_for(expected_calls=100)
    see(policy, "small", eager_s=0.010, size=64)
    for _ in range(SAMPLES):
        policy.record_replay("small", 0.0095)  # the graph saves only 5%
    see(policy, "large", eager_s=0.010, size=128, tokens=64)
    see(policy, "large", size=128, tokens=64)
    # Half of "large" is padding: 0.95 x 2 of its eager time, no gain.
    assert policy.estimates("large")["graph_s"] == pytest.approx(0.010 * 0.95 * 2)
    assert policy.decide("large") == NO_GAIN


@pytest.mark.parametrize(
    ("size", "nearest_ratio"), [(96, 0.2), (768, 0.8)], ids=["near-small", "near-large"]
)
def test_an_unmeasured_graph_is_scaled_from_the_nearest_measured_size(size, nearest_ratio):
    policy = policy_for(expected_calls=100)
    for key, budget, ratio in (("small", 64, 0.2), ("large", 1024, 0.8)):
        see(policy, key, eager_s=0.010, size=budget)
        for _ in range(SAMPLES):
            policy.record_replay(key, 0.010 * ratio)  # graph / eager of a full budget
    see(policy, "new", eager_s=0.010, size=size)
    assert policy.estimates("new")["graph_s"] == pytest.approx(0.010 * nearest_ratio)


def test_eager_calls_that_take_as_long_at_every_size_give_no_cost_per_token():
    # A flat line promises no graph for free: the prior stands.
    policy = policy_for(expected_calls=1000)
    for tokens in (64, 1024):
        policy.record_eager_call("local", tokens, 0.010)
    see(policy, "a", eager_s=0.010, size=1024, tokens=1024)
    assert policy.estimates("a")["graph_s"] == pytest.approx(PRIOR_GRAPH_RATIO * 0.010)


def test_slower_than_eager_needs_enough_replays_and_can_be_turned_off():
    for drop, expected in ((True, True), (False, False)):
        policy = policy_for(expected_calls=100, drop_slower_graphs=drop)
        see(policy, "a", eager_s=0.010)
        for _ in range(SAMPLES):
            assert not policy.slower_than_eager("a")  # too few replays timed
            policy.record_replay("a", 0.011)
        assert policy.slower_than_eager("a") is expected


def test_eager_time_follows_the_real_tokens_a_key_serves():
    # A graph computes its whole budget; eager only the real tokens. Timed on a
    # full sub-batch, eager looks slow; the key mostly serves quarter-full ones.
    policy = policy_for(expected_calls=100)
    see(policy, "a", eager_s=0.010, size=64, tokens=64)
    for _ in range(SAMPLES):
        policy.record_replay("a", 0.008)
    assert not policy.slower_than_eager("a")
    for _ in range(7):
        see(policy, "a", size=64, tokens=16)
    # Mean real tokens (64 + 7 x 16) / 8 = 22: eager about 0.0034 s < 0.008 s.
    assert policy.estimates("a")["eager_s"] == pytest.approx(0.010 / 64 * 22)
    assert policy.slower_than_eager("a")


def test_a_key_mostly_padding_is_not_expected_to_gain():
    # Half of the budget is padding: at the prior cost per padded token (half
    # of eager's per real token) the graph costs what eager does.
    policy = policy_for(expected_calls=1000)
    see(policy, "half_padding", eager_s=0.010, size=64, tokens=32)
    assert see(policy, "half_padding", size=64, tokens=32) == NO_GAIN
    full = policy_for(expected_calls=1000)
    see(full, "full", eager_s=0.010, size=64, tokens=64)
    assert see(full, "full", size=64, tokens=64) == CAPTURE


def path_with_eager_calls(policy: CapturePolicy, seconds: dict[int, float]) -> CapturePolicy:
    """``policy`` whose path ran eagerly on these token counts in these seconds."""
    for tokens, spent in seconds.items():
        policy.record_eager_call("local", tokens, spent)
        policy.sighted(f"seen_{tokens}", "local", 4096, tokens)
    return policy


def test_eager_calls_mostly_launches_promise_a_gain_despite_padding():
    # 10 ms of launches whatever the size, plus 0.1 us a token: a graph removes
    # the launches and keeps the work, its budget at the line's slope.
    policy = path_with_eager_calls(
        policy_for(expected_calls=1000), {64: 0.010 + 64e-7, 4096: 0.010 + 4096e-7}
    )
    see(policy, "a", eager_s=0.010, size=1024, tokens=600)
    assert policy.estimates("a")["graph_s"] == pytest.approx(1e-7 * 1024, rel=0.01)
    assert see(policy, "a", size=1024, tokens=600) == CAPTURE
    # Compiled graphs fuse work: the line's slope does not bound them either way.
    fused = path_with_eager_calls(
        policy_for(expected_calls=1000), {64: 0.010 + 64e-7, 4096: 0.010 + 4096e-7}
    )
    fused.graphs_fuse_work = True
    see(fused, "a", eager_s=0.010, size=1024, tokens=600)
    padding = 1024 / 600
    assert fused.estimates("a")["graph_s"] == pytest.approx(PRIOR_GRAPH_RATIO * padding * 0.010)


def test_a_graph_that_promised_too_much_is_measured_and_its_path_stays_eager():
    # Eager calls of 1000 to 3000 tokens all took 10 ms: launches alone, or GPU
    # work the launches hide; the line has no slope and the prior promises a
    # gain. The captured graph is measured slower than eager: its key goes back
    # to eager, and the path's other budgets, scaled from it, expect no gain.
    policy = path_with_eager_calls(
        policy_for(expected_calls=1000), {1000: 0.010, 2000: 0.010, 3000: 0.010}
    )
    see(policy, "big", eager_s=0.010, size=4096, tokens=2900)
    assert see(policy, "big", size=4096, tokens=2900) == CAPTURE
    policy.record_capture("big", 0.05)
    for _ in range(SAMPLES):
        policy.record_replay("big", 0.0137)
    assert policy.slower_than_eager("big")
    see(policy, "other", eager_s=0.010, size=3072, tokens=2900)
    assert see(policy, "other", size=3072, tokens=2900) == NO_GAIN


def test_forgotten_graphs_keep_what_the_eager_runs_taught():
    policy = policy_for(expected_calls=None)
    for _ in range(8):
        see(policy, "a", eager_s=0.01)
    for _ in range(SAMPLES):
        policy.record_replay("a", 0.02)
    assert policy.slower_than_eager("a")
    policy.forget_graphs()
    assert not policy.slower_than_eager("a")
    assert policy.decide("a") == CAPTURE  # the eager time spent still buys it


# ----------------------------------------------------------- through the manager


def toy_manager(drop_slower_graphs: bool = True, **options) -> tuple:
    """A manager of the toy tower; ``drop_slower_graphs=False`` keeps the CPU's noisy
    replay timings from sending its key back to eager."""
    torch.manual_seed(0)
    tower = ToyTower().eval()
    manager = EncoderGraphManager(ToyEncoder(tower), budgets={"budgets": [16, 64]}, **options)
    manager.policy.drop_slower_graphs = drop_slower_graphs
    tokens, lengths = torch.randn(12, 8), torch.tensor([5, 7])
    inputs = manager.encoder.inputs_from_call((tokens, lengths), {})
    return tower, manager, inputs, tower(tokens, lengths).detach()


def run_calls(manager, inputs, calls: int) -> list:
    with torch.no_grad():
        return [manager.execute(inputs) for _ in range(calls)]


def test_manager_captures_a_recurring_key_once_the_run_can_repay_it():
    _, manager, inputs, expected = toy_manager(drop_slower_graphs=False)
    manager.begin_run(expected_calls=100)
    outputs = run_calls(manager, inputs, 5)
    # Call 1 eager (seen once); call 2 captures (98 calls left x half an eager
    # run >= 5 eager runs) and replays from then on.
    assert (manager.stats.eager_no_graph_yet, manager.stats.hits) == (1, 4)
    assert len(manager.cache) == 1
    for output in outputs:
        torch.testing.assert_close(output, expected)


def test_manager_leaves_a_short_first_run_eager_and_captures_in_a_later_longer_one():
    # A fresh process: the first capture costs 4 x 5 eager runs; a replay saves
    # a third of one (12 real tokens in a budget of 16). Ten calls cannot repay
    # it, and spend less than half of it.
    _, manager, inputs, _ = toy_manager(drop_slower_graphs=False)
    manager.begin_run(expected_calls=10)
    run_calls(manager, inputs, 10)
    assert manager.stats.hits == 0 and manager.stats.eager_no_graph_yet == 10
    assert not manager.is_captured()
    manager.begin_run(expected_calls=100)  # 99 calls x a third >= 20: at once
    run_calls(manager, inputs, 3)
    assert manager.stats.eager_no_graph_yet == 0 and manager.stats.hits == 3


def test_manager_captures_a_key_that_recurs_in_short_runs_and_then_replays_it():
    # Runs of 6 calls never repay the first capture (20 eager runs) themselves;
    # the eager time they spend on the key adds up to it in about the fourth run.
    _, manager, inputs, expected = toy_manager(drop_slower_graphs=False)
    hits = []
    outputs = []
    for _ in range(6):
        manager.begin_run(expected_calls=6)
        outputs += run_calls(manager, inputs, 6)
        hits.append(manager.stats.hits)
    assert hits[0] == 0  # 5 eager runs spent: a quarter of the cost
    assert hits[-1] == 6 and manager.stats.graphs_captured == 0
    assert len(manager.cache) == 1
    for output in outputs:
        torch.testing.assert_close(output, expected)


def test_manager_lets_a_fit_validation_run_pay_for_the_runs_known_to_follow():
    # The tower's first capture costs 2 x 5 eager runs, a replay saves a third
    # of one (12 real tokens in a 16-token budget). Three runs known to follow
    # will come, so at the second call the 8 calls left and their 30 (38 x a
    # third >= 10) repay the capture.
    _, manager, inputs, expected = toy_manager(drop_slower_graphs=False)
    manager.begin_run(expected_calls=10, later_runs=3)
    for output in run_calls(manager, inputs, 10):
        torch.testing.assert_close(output, expected)
    assert (manager.stats.eager_no_graph_yet, manager.stats.hits) == (1, 9)
    # Alone, a run of 10 stays eager (8 x a third < 10), and so does the next
    # (9 eager runs spent < 10). After two, 19 eager runs spent exceed the
    # capture's cost: the third run captures at its first call.
    _, alone, inputs, _ = toy_manager(drop_slower_graphs=False)
    for _ in range(2):
        alone.begin_run(expected_calls=10)
        run_calls(alone, inputs, 10)
        assert alone.stats.eager_no_graph_yet == 10 and not alone.is_captured()
    alone.begin_run(expected_calls=10)
    run_calls(alone, inputs, 2)
    assert (alone.stats.eager_no_graph_yet, alone.stats.hits) == (0, 2)


def test_manager_sends_a_key_whose_graph_is_slower_back_to_eager():

    from toy_encoder import ToyEncoder

    class SlowGraph(ToyEncoder):
        def graph_forward(self, path, buffers):
            time.sleep(0.02)
            return super().graph_forward(path, buffers)

    tower, manager, inputs, expected = toy_manager()
    manager = type(manager)(SlowGraph(tower), budgets={"budgets": [16, 64]})
    manager.begin_run(expected_calls=1000)
    for output in run_calls(manager, inputs, 1 + SAMPLES + 2):
        torch.testing.assert_close(output, expected)
    stats = manager.stats
    assert (stats.eager_no_graph_yet, stats.hits, stats.eager_measured_slower) == (1, SAMPLES, 2)
    # Graphs freed for memory (keep_graphs=False) come back the same: the key stays eager.
    manager.clear(keep_timings=True)
    manager.begin_run(expected_calls=1000)
    run_calls(manager, inputs, 3)
    assert (stats.hits, stats.eager_policy, len(manager.cache)) == (0, 3, 0)
    # A tower that changed forgets what the old graphs measured: captured and timed anew.
    manager.clear()
    manager.begin_run(expected_calls=1000)
    run_calls(manager, inputs, 2)
    assert stats.hits == 2 and len(manager.cache) == 1


def test_upfront_captures_each_paths_whole_ladder_at_its_first_call():
    _, manager, inputs, expected = toy_manager(capture="upfront")
    with torch.no_grad():
        output = manager.execute(inputs)
    torch.testing.assert_close(output, expected)
    assert manager.stats.eager_no_graph_yet == 0 and manager.stats.hits > 0
    # The toy tower's items have local tokens only.
    budgets = {key.descriptor.num_tokens for key in manager.cache.keys() if key.path == "local"}
    assert budgets == {16, 64}
    captured = len(manager.cache)
    run_calls(manager, inputs, 2)
    assert len(manager.cache) == captured


def test_manager_times_an_eager_path_beside_a_replayed_one_and_captures_it():
    # The local path's graphs exist; the global path's key is first seen in sub-batches
    # whose local rows replay. Its eager runs there are timed, so the rule can weigh it:
    # a budget it fills (a replay saves half an eager run) is captured at its second
    # sighting, since 1000 calls repay even a process's first capture (20 eager runs).
    torch.manual_seed(0)
    tower = ToyTower(global_tokens=4).eval()
    manager = EncoderGraphManager(
        ToyEncoder(tower), budgets={"budgets": [16, 64]}, paths={"global": {"budgets": [8]}}
    )
    manager.policy.drop_slower_graphs = False
    tokens, lengths = torch.randn(12, 8), torch.tensor([5, 7])
    inputs = manager.encoder.inputs_from_call((tokens, lengths), {})
    manager.capture(manager.encoder.graph_signature(inputs), paths=["local"])
    manager.begin_run(expected_calls=1000)
    for output in run_calls(manager, inputs, 5):
        torch.testing.assert_close(output, tower(tokens, lengths).detach())
    assert [key.path for key in manager.cache.keys()].count("global") == 1
    assert (manager.stats.eager_no_graph_yet, manager.stats.hits) == (1, 5 + 4)


def test_a_capture_that_costs_more_than_the_runs_eager_time_is_named():
    # 10 calls of 10 ms: 90 ms of eager time counted (from the key's second
    # sighting on). A capture of 0.5 s exceeds it, one of 20 ms does not; the
    # next run starts with none named.
    policy = policy_for(expected_calls=10)
    see(policy, "quick", eager_s=0.01)
    for _ in range(10):
        see(policy, "slow", eager_s=0.01)
    policy.record_capture("slow", 0.5)
    policy.record_capture("quick", 0.02)
    (costly,) = policy.costly_captures()
    assert costly.key == "slow" and costly.seconds == 0.5
    assert costly.run_eager_seconds == pytest.approx(0.09)
    policy.begin_run(expected_calls=10)
    assert policy.costly_captures() == []


def test_a_capture_of_several_keys_names_each_keys_share():
    # upfront captures a path's ladder at once: 0.5 s for 10 keys is 50 ms each,
    # less than the run's 90 ms of eager time, so none is named.
    policy = policy_for(expected_calls=10)
    for _ in range(10):
        see(policy, "a", eager_s=0.01)
    policy.record_capture("a", 0.5, keys=10)
    assert policy.costly_captures() == []
    assert policy.estimates("a")["capture_s"] == pytest.approx(0.05)
