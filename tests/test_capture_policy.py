"""CapturePolicy: which keys are captured when, from injected timings, and through the manager."""

import time

import pytest
import torch
from toy_encoder import ToyEncoder, ToyTower

from lightning_cg.capture_policy import (
    CAPTURE,
    NO_GAIN,
    RUN_SLACK,
    SAMPLES,
    WAIT,
    CapturePolicy,
)
from lightning_cg.cost_estimates import FIT_PATIENCE, PRIOR_CAPTURE_RATIO, PRIOR_GRAPH_RATIO
from lightning_cg.manager import EncoderGraphManager


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


def test_first_use_captures_at_the_first_sighting():
    policy = CapturePolicy(first_use=True)
    policy.begin_run(expected_calls=None)
    assert see(policy, "a") == CAPTURE


def test_a_key_waits_for_min_sightings_and_a_timing():
    policy = CapturePolicy(min_sightings=2)
    policy.begin_run(expected_calls=1000)
    assert see(policy, "a", eager_s=0.01) == WAIT  # seen once
    assert see(policy, "a") == CAPTURE  # seen twice, ample calls left
    untimed = CapturePolicy(min_sightings=1)
    untimed.begin_run(expected_calls=1000)
    assert see(untimed, "b") == WAIT  # no eager time measured yet


def test_a_short_run_does_not_capture_what_it_cannot_repay():
    # Prior: capture costs 5 eager runs, a replay saves half an eager run, so a
    # capture pays after 10 replays.
    assert PRIOR_CAPTURE_RATIO / (1 - PRIOR_GRAPH_RATIO) == 10
    short = CapturePolicy(min_sightings=2, repay_runs=1)
    short.begin_run(expected_calls=8)
    decisions = [see(short, "a", eager_s=0.01) for _ in range(8)]
    assert CAPTURE not in decisions
    long = CapturePolicy(min_sightings=2, repay_runs=1)
    long.begin_run(expected_calls=13)
    decisions = [see(long, "a", eager_s=0.01) for _ in range(3)]
    # Second sighting: 11 calls left x 0.005 s saved >= 0.05 s capture.
    assert decisions == [WAIT, CAPTURE, CAPTURE]


def test_graphs_outlive_the_run_so_a_capture_may_be_repaid_by_later_runs():
    # repay_runs=2 (the default): a run of 8 and one more like it.
    policy = CapturePolicy(min_sightings=2)
    policy.begin_run(expected_calls=8)
    assert policy.horizon_calls() == 16
    see(policy, "a", eager_s=0.01)
    # First sighting: 7 calls left + 8, once per call.
    assert policy.estimates("a")["expected_sightings"] == 7 + 8
    fewer = CapturePolicy(min_sightings=2)
    fewer.begin_run(expected_calls=4)
    see(fewer, "a", eager_s=0.01)
    assert fewer.estimates("a")["expected_sightings"] == 3 + 4


def test_a_run_captures_what_later_runs_repay_only_within_its_allowance():
    # A run of 8 and one more like it repay a capture of "a" ((6 + 8) x 0.005 s
    # >= 0.05 s), but this run would pay 0.05 - 6 x 0.005 = 0.02 s of it, more
    # than RUN_SLACK of its 8 x 0.01 s eager: it stays eager.
    assert 0.02 > RUN_SLACK * 0.08
    policy = CapturePolicy(min_sightings=2)
    policy.begin_run(expected_calls=8)
    assert CAPTURE not in [see(policy, "a", eager_s=0.01) for _ in range(8)]


@pytest.mark.parametrize("later_runs, captured_at", [(None, None), (0, None), (1, 1)])
def test_runs_known_to_follow_may_pay_for_a_capture(later_runs, captured_at):
    # As above, a run of 8 and one more like it repay a capture of "a". A run
    # known to follow (a fit's next validation run) will come, so this run may
    # capture "a" at its second sighting: (6 + 8) x 0.005 s >= 0.05 s.
    policy = CapturePolicy(min_sightings=2)
    policy.begin_run(expected_calls=8, later_runs=later_runs)
    assert policy.committed_calls() == 8 + (later_runs or 0) * 8
    decisions = [see(policy, "a", eager_s=0.01) for _ in range(8)]
    assert (decisions.index(CAPTURE) if CAPTURE in decisions else None) == captured_at


@pytest.mark.parametrize("replays_of_b, captured_at", [(False, None), (True, 1)])
def test_what_a_runs_graphs_save_funds_captures_that_later_runs_repay(replays_of_b, captured_at):
    # "b" was captured in an earlier run, at 3 eager runs (the path's capture
    # ratio), and its replays take half its eager time.
    policy = CapturePolicy(min_sightings=2, drop_slower_graphs=False)
    policy.begin_run(expected_calls=8)
    see(policy, "b", eager_s=0.01)
    policy.record_capture("b", 0.03)
    policy.record_replay("b", 0.005)
    policy.begin_run(expected_calls=8)
    decisions = []
    for _ in range(8):
        policy.called()
        if replays_of_b:
            policy.sighted("b", "local", 64, 64)
        policy.sighted("a", "local", 64, 64)
        if policy.wants_eager_timing("a"):
            policy.record_eager("a", 0.01, 64)
        decisions.append(policy.decide("a"))
    # Second sighting of "a": (2/3 x 6) x 0.005 s of its 0.03 s repaid in this
    # run; the 0.01 s left exceeds RUN_SLACK of the run's eager time alone,
    # not with the 2 x 0.005 s that the replays of "b" saved.
    index = decisions.index(CAPTURE) if CAPTURE in decisions else None
    assert index == captured_at


def test_the_run_allowance_counts_eager_time_savings_and_captures_of_this_run_only():
    policy = CapturePolicy(min_sightings=2, drop_slower_graphs=False)
    policy.begin_run(expected_calls=10)
    for _ in range(5):
        see(policy, "a", eager_s=0.01)
    # 4 sub-batches of 0.01 s (the first was seen before its timing), scaled to 10 calls.
    assert policy.run_allowance() == pytest.approx(RUN_SLACK * 0.04 * 10 / 5)
    policy.record_capture("a", 0.02)
    see(policy, "a")  # a replay not timed yet: it saves nothing so far
    policy.record_replay("a", 0.004)
    see(policy, "a")  # saves 0.01 - 0.004 s
    expected = RUN_SLACK * (0.06 * 10 / 7) + 0.006 - 0.02
    assert policy.run_allowance() == pytest.approx(expected)
    # A new run starts from its own eager time, with nothing saved or spent yet.
    policy.begin_run(expected_calls=10)
    see(policy, "a")
    assert policy.run_allowance() == pytest.approx(RUN_SLACK * 0.1 + 0.006)


def test_runs_known_to_follow_extend_the_horizon_when_they_are_more():
    policy = CapturePolicy(min_sightings=2, repay_runs=1)
    policy.begin_run(expected_calls=4, later_runs=3)  # a fit's validation runs to come
    assert policy.horizon_calls() == 4 + 3 * 4
    see(policy, "a", eager_s=0.01)
    assert policy.estimates("a")["expected_sightings"] == 3 + 3 * 4
    policy.begin_run(expected_calls=4, later_runs=0)  # the last one
    assert policy.horizon_calls() == 4
    fewer = CapturePolicy(repay_runs=3)
    fewer.begin_run(expected_calls=4, later_runs=1)
    assert fewer.horizon_calls() == 4 + 2 * 4


def test_without_a_horizon_a_key_is_captured_once_its_past_would_have_repaid_it():
    policy = CapturePolicy(min_sightings=2, repay_runs=1)
    policy.begin_run(expected_calls=None)
    decisions = [see(policy, "a", eager_s=0.01) for _ in range(10)]
    # As many sightings again as so far: 10 x 0.005 s >= 0.05 s at the tenth.
    assert decisions.index(CAPTURE) == 9
    # One later run as long as this one would be (so far and as many again)
    # repays it from the fourth sighting (3 x 4 x 0.005 s >= 0.05 s), but this
    # run's allowance (RUN_SLACK of twice the k - 1 timed sightings' 0.01 s)
    # covers the unpaid 0.05 - k x 0.005 s only from the tenth.
    default = CapturePolicy(min_sightings=2)
    default.begin_run(expected_calls=None)
    assert [see(default, "a", eager_s=0.01) for _ in range(10)].index(CAPTURE) == 9


def test_runs_of_unknown_length_are_expected_as_long_as_the_last_one():
    policy = CapturePolicy()
    policy.begin_run(expected_calls=None)
    for _ in range(10):
        policy.called()
    assert policy.remaining_calls() == 10  # the first run: as many again as so far
    policy.begin_run(expected_calls=None)
    assert policy.remaining_calls() == 10  # as long as the last run
    for _ in range(4):
        policy.called()
    assert policy.remaining_calls() == 6
    horizon = policy.horizon_calls()
    for _ in range(3):  # runs of the same length: the same estimate, however many came before
        for _ in range(6):
            policy.called()
        policy.begin_run(expected_calls=None)
        for _ in range(4):
            policy.called()
        assert policy.horizon_calls() == horizon
    for _ in range(20):
        policy.called()
    assert policy.remaining_calls() == 24  # longer than the last run: as many again


def test_a_rare_key_among_frequent_ones_waits():
    policy = CapturePolicy(min_sightings=2)
    policy.begin_run(expected_calls=40)
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
    # rare: 2 of 22 sub-batches: about 2 further sightings x 0.005 s < 0.05 s
    assert policy.decide("rare") == WAIT


def test_measured_graph_and_capture_times_replace_the_priors():
    policy = CapturePolicy(min_sightings=1)
    policy.begin_run(expected_calls=100)
    see(policy, "small", eager_s=0.010, size=64)
    policy.record_capture("small", 0.020)  # 2 eager runs, not 5
    for _ in range(SAMPLES):
        policy.record_replay("small", 0.0095)  # the graph saves only 5%
    see(policy, "large", eager_s=0.010, size=128)
    estimates = policy.estimates("large")
    assert estimates["graph_ratio"] == pytest.approx(0.95)
    assert estimates["capture_ratio"] == pytest.approx(2.0)


def test_no_gain_when_graphs_of_the_path_are_slower():
    policy = CapturePolicy(min_sightings=1)
    policy.begin_run(expected_calls=100)
    see(policy, "a", eager_s=0.010, size=64)
    for _ in range(SAMPLES):
        policy.record_replay("a", 0.012)
    assert see(policy, "b", eager_s=0.010, size=64) == NO_GAIN


def test_slower_than_eager_needs_enough_replays_and_can_be_turned_off():
    for drop, expected in ((True, True), (False, False)):
        policy = CapturePolicy(min_sightings=1, drop_slower_graphs=drop)
        policy.begin_run(expected_calls=100)
        see(policy, "a", eager_s=0.010)
        for _ in range(SAMPLES):
            assert not policy.slower_than_eager("a")  # too few replays timed
            policy.record_replay("a", 0.011)
        assert policy.slower_than_eager("a") is expected


def test_eager_time_follows_the_real_tokens_a_key_serves():
    # A graph computes its whole budget; eager only the real tokens. Timed on a
    # full sub-batch, eager looks slow; the key mostly serves quarter-full ones.
    policy = CapturePolicy(min_sightings=1)
    policy.begin_run(expected_calls=100)
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
    policy = CapturePolicy(min_sightings=1)
    policy.begin_run(expected_calls=1000)
    # Half of the budget is padding: at the prior cost per padded token (half
    # of eager's per real token) the graph costs what eager does.
    assert see(policy, "half_padding", eager_s=0.010, size=64, tokens=32) == NO_GAIN
    policy = CapturePolicy(min_sightings=1)  # one token count: no wait for a cost line
    policy.begin_run(expected_calls=1000)
    assert see(policy, "full", eager_s=0.010, size=64, tokens=64) == CAPTURE


def path_with_eager_calls(
    fixed_s: float, per_token_s: float, graphs_fuse_work: bool = False
) -> CapturePolicy:
    """A policy whose path ran eagerly at 64 and 1024 tokens, costing
    ``fixed_s + per_token_s x tokens``; nothing captured yet."""
    policy = CapturePolicy(min_sightings=1, graphs_fuse_work=graphs_fuse_work)
    policy.begin_run(expected_calls=1000)
    for tokens in (64, 1024):
        policy.record_eager_call("local", tokens, fixed_s + per_token_s * tokens)
    return policy


def test_eager_calls_mostly_launches_promise_a_gain_despite_padding():
    # 10 ms of launches whatever the size: a graph removes them.
    policy = path_with_eager_calls(fixed_s=0.010, per_token_s=1e-7)
    # The first sighting: the run's allowance is still empty, and the eager times
    # cannot rule out GPU work behind those launches (see the test below).
    assert see(policy, "a", eager_s=0.010, size=1024, tokens=600) == WAIT
    assert see(policy, "a", eager_s=0.010, size=1024, tokens=600) == CAPTURE
    assert policy.estimates("a")["graph_ratio"] == pytest.approx(1e-7 * 1024 / 0.010, rel=0.01)


def flat_path(expected_calls: int) -> CapturePolicy:
    """A path whose eager calls of 1000 to 3000 tokens all took 10 ms: launches
    alone, or GPU work the launches hide; the line cannot tell which."""
    policy = CapturePolicy(min_sightings=1)
    policy.begin_run(expected_calls=expected_calls)
    for tokens in (1000, 2000, 3000):
        policy.record_eager_call("local", tokens, 0.010)
    return policy


def test_a_gain_the_eager_times_cannot_promise_is_risked_only_within_the_run_allowance():
    # At its worst, 3000 tokens in 10 ms of GPU work, a 4096-token graph costs
    # 13.7 ms against eager's 10: its capture (50 ms) may be lost whole, which a
    # run of 100 calls (allowance 3% of 1 s) cannot afford and one of 1000 can.
    short = flat_path(expected_calls=100)
    decisions = [see(short, "big", eager_s=0.010, size=4096, tokens=2900) for _ in range(100)]
    assert short.estimates("big")["graph_ratio"] < 1  # a gain is expected
    assert CAPTURE not in decisions
    long = flat_path(expected_calls=1000)
    decisions = [see(long, "big", eager_s=0.010, size=4096, tokens=2900) for _ in range(2)]
    assert decisions == [WAIT, CAPTURE]


def test_a_small_budget_on_a_flat_path_is_promised_its_gain():
    # Even at 3.3 us of GPU work per token, a 1024-token graph costs 3.4 ms
    # against eager's 10: the 100-call run repays its capture.
    short = flat_path(expected_calls=100)
    assert see(short, "small", eager_s=0.010, size=1024, tokens=900) == CAPTURE


def test_eager_calls_that_fill_the_gpu_promise_no_gain_to_a_padded_graph():
    # No fixed cost: the graph would do the same work per token, and its padding too.
    policy = path_with_eager_calls(fixed_s=0.0, per_token_s=1e-5)
    assert see(policy, "a", eager_s=1e-5 * 600, size=1024, tokens=600) == NO_GAIN
    assert policy.estimates("a")["graph_ratio"] == pytest.approx(1024 / 600)


def test_compiled_graphs_are_not_bounded_by_the_eager_line():
    # The same GPU-filling path as above, but the graphs run fused kernels: the
    # prior decides until a graph is measured, and no wait for the line either.
    policy = path_with_eager_calls(fixed_s=0.0, per_token_s=1e-5, graphs_fuse_work=True)
    assert see(policy, "a", eager_s=1e-5 * 600, size=1024, tokens=600) == CAPTURE
    assert policy.estimates("a")["graph_ratio"] == pytest.approx(PRIOR_GRAPH_RATIO * 1024 / 600)
    waiting = CapturePolicy(min_sightings=2, graphs_fuse_work=True)
    waiting.begin_run(expected_calls=1000)
    see(waiting, "k", eager_s=0.015, size=4096, tokens=3000)
    assert see(waiting, "k", size=4096, tokens=3500) == CAPTURE


def test_a_path_of_several_sizes_waits_for_its_cost_line_before_the_first_capture():
    policy = CapturePolicy(min_sightings=1)
    policy.begin_run(expected_calls=1000)
    policy.record_eager_call("local", 256, 0.010)
    policy.sighted("large", "local", size=256, tokens=256)
    # A full key the prior would capture, but the path has two sizes and one eager size.
    assert see(policy, "small", eager_s=0.005, size=128) == WAIT
    policy.record_eager_call("local", 128, 0.0099)  # launches, mostly: the line says capture
    assert see(policy, "small") == CAPTURE


def test_sub_batches_of_one_budget_but_varied_tokens_wait_for_the_cost_line():
    # Mixed batches that all fit one budget: one key, so the wait must not hang
    # on keys of several sizes; the prior alone would capture a padded graph.
    policy = CapturePolicy(min_sightings=2)
    policy.begin_run(expected_calls=1000)
    assert see(policy, "k", eager_s=0.015, size=4096, tokens=3000) == WAIT  # one sighting
    policy.record_eager_call("local", 3000, 0.015)
    assert see(policy, "k", size=4096, tokens=3500) == WAIT  # the prior would capture
    policy.record_eager_call("local", 3500, 0.0175)  # all GPU work: the line says no
    assert see(policy, "k", size=4096, tokens=3200) == NO_GAIN


def test_sub_batches_of_equal_tokens_do_not_wait_for_a_line_that_cannot_come():
    policy = CapturePolicy(min_sightings=1)
    policy.begin_run(expected_calls=1000)
    assert see(policy, "k", eager_s=0.010, size=256, tokens=256) == CAPTURE


def test_the_wait_for_the_cost_line_ends_after_enough_eager_calls():
    policy = CapturePolicy(min_sightings=1)
    policy.begin_run(expected_calls=1000)
    see(policy, "small", eager_s=0.005, size=128)
    for _ in range(FIT_PATIENCE):
        assert see(policy, "large", eager_s=0.010, size=256) == WAIT
        policy.record_eager_call("local", 256, 0.010)  # one size only: no line
    assert see(policy, "large") == CAPTURE


def test_one_size_of_eager_calls_leaves_the_prior():
    policy = CapturePolicy(min_sightings=1)
    policy.begin_run(expected_calls=1000)
    for _ in range(3):
        policy.record_eager_call("local", 256, 0.010)
    see(policy, "a", eager_s=0.010, size=256, tokens=256)
    assert policy.estimates("a")["graph_ratio"] == pytest.approx(PRIOR_GRAPH_RATIO)


def test_a_measured_key_informs_others_by_cost_per_padded_token():
    policy = CapturePolicy(min_sightings=1)
    policy.begin_run(expected_calls=100)
    see(policy, "measured", eager_s=0.010, size=60, tokens=50)  # padding factor 1.2
    for _ in range(SAMPLES):
        policy.record_replay("measured", 0.006)  # 0.6 of eager: 0.5 per padded token
    see(policy, "other", eager_s=0.010, size=60, tokens=40)  # padding factor 1.5
    assert policy.estimates("other")["graph_ratio"] == pytest.approx(0.75)


def test_forget_graphs_keeps_sightings_and_eager_times():
    policy = CapturePolicy(min_sightings=1)
    policy.begin_run(expected_calls=100)
    see(policy, "a", eager_s=0.010)
    for _ in range(SAMPLES):
        policy.record_replay("a", 0.02)
    policy.forget_graphs()
    estimates = policy.estimates("a")
    assert estimates["graph_s"] is None and estimates["eager_s"] == pytest.approx(0.010)
    assert estimates["sightings"] == 1 and not policy.slower_than_eager("a")


# ----------------------------------------------------------- through the manager


def toy_manager(**options) -> tuple:
    torch.manual_seed(0)
    tower = ToyTower().eval()
    manager = EncoderGraphManager(ToyEncoder(tower), budgets={"budgets": [16, 64]}, **options)
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


@pytest.mark.parametrize("repay_runs, calls", [(1, 10), (2, 4)])
def test_manager_leaves_a_short_run_eager_and_captures_in_a_later_longer_one(repay_runs, calls):
    # Prior: a capture pays after 10 replays. 10 calls alone, or 4 calls and
    # one more run of 4, cannot give them.
    _, manager, inputs, _ = toy_manager(drop_slower_graphs=False, repay_runs=repay_runs)
    manager.begin_run(expected_calls=calls)
    run_calls(manager, inputs, calls)
    assert manager.stats.hits == 0 and manager.stats.eager_no_graph_yet == calls
    assert not manager.is_captured()
    manager.begin_run(expected_calls=100)
    run_calls(manager, inputs, 3)
    assert manager.stats.eager_no_graph_yet == 0 and manager.stats.hits == 3


def test_manager_leaves_eager_a_short_run_that_only_the_next_run_would_repay():
    # Prior: a capture costs 5 eager runs and saves a third of one per replay
    # (12 real tokens in a budget of 16). In 10 calls and one more run of 10 it
    # would pay, but the first run would carry most of it: both runs stay eager.
    _, manager, inputs, expected = toy_manager(drop_slower_graphs=False)
    for _ in range(2):
        manager.begin_run(expected_calls=10)
        outputs = run_calls(manager, inputs, 10)
        assert manager.stats.hits == 0 and manager.stats.eager_no_graph_yet == 10
    assert not manager.is_captured()
    # A run of 20 repays it itself (19 calls left x a third >= 5): it captures
    # at its first call (the key was seen before), and the next run captures nothing.
    manager.begin_run(expected_calls=20)
    outputs += run_calls(manager, inputs, 20)
    assert manager.stats.hits == 20 and len(manager.cache) == 1
    manager.begin_run(expected_calls=10)
    outputs += run_calls(manager, inputs, 10)
    assert manager.stats.hits == 10 and manager.stats.graphs_captured == 0
    for output in outputs:
        torch.testing.assert_close(output, expected)


@pytest.mark.parametrize("later_runs, captured", [(None, False), (0, False), (1, True)])
def test_manager_lets_a_fit_validation_run_pay_for_the_runs_known_to_follow(later_runs, captured):
    # As above, a capture costs 5 eager runs and a replay saves a third of one.
    # A fit's validation run still to come will come, so at the second call the
    # 8 calls left and its 10 (18 x a third >= 5) repay the capture.
    _, manager, inputs, expected = toy_manager(drop_slower_graphs=False)
    manager.begin_run(expected_calls=10, later_runs=later_runs)
    for output in run_calls(manager, inputs, 10):
        torch.testing.assert_close(output, expected)
    assert manager.is_captured() is captured
    assert manager.stats.hits == (9 if captured else 0)


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
