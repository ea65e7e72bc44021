"""GpuWork and the probes of a key's GPU work: when the capture policy asks for
one, how it reads the result, and the call runner's probes through the manager."""

import contextlib

import pytest
import torch
from test_capture_policy import run_calls, see, toy_manager

from lightning_cg.call_timer import CallTimer, Timing
from lightning_cg.capture_policy import (
    CAPTURE,
    NO_GAIN,
    PRIOR_GRAPH_RATIO,
    RUN_SLACK,
    WAIT,
    CapturePolicy,
)
from lightning_cg.gpu_work import HOLD_MARGIN, GpuWork


def test_a_key_is_wanted_until_a_probe_measures_it():
    work = GpuWork()
    assert not work.wanted("a")
    assert work.want("a", path="local") and work.wanted("a") and not work.wanted("b")
    work.record("a", tokens=500, seconds=0.001)
    assert work.per_token("a") == pytest.approx(2e-6)
    assert not work.wanted("a") and not work.want("a", path="local")


def test_a_path_whose_probe_measured_nothing_is_not_probed_again():
    work = GpuWork()
    assert work.want("a", "local") and work.want("b", "local") and work.want("c", "global")
    work.unmeasured("a")
    assert not work.wanted("a") and not work.wanted("b") and work.wanted("c")
    assert not work.want("d", "local") and work.want("e", "global")
    assert work.per_token("a") is None


def probing_policy(expected_calls: int = 1000, **options) -> CapturePolicy:
    policy = CapturePolicy(min_sightings=2, measures_gpu_work=True, **options)
    policy.begin_run(expected_calls=expected_calls)
    return policy


def test_a_first_capture_waits_for_a_probe_then_follows_the_gpu_work():
    # Eager calls take 4 ms, mostly launches: the GPU works 0.7 ms of them.
    policy = probing_policy()
    assert see(policy, "a", eager_s=0.004) == WAIT  # seen once
    assert see(policy, "a") == WAIT and policy.wants_gpu_work("a")
    policy.record_gpu_work("a", tokens=64, seconds=0.0007)
    assert not policy.wants_gpu_work("a")
    assert see(policy, "a") == CAPTURE
    assert policy.estimates("a")["graph_ratio"] == pytest.approx(0.0007 / 0.004)


def test_gpu_work_close_behind_the_launches_promises_no_gain_to_a_padded_graph():
    # 12 ms eager calls of 600 real tokens: launch-bound, so an eager line of
    # several sizes would read as fixed cost; but the GPU works 9 ms of them, and
    # a graph computes its whole budget of 1024 tokens: 15.4 ms.
    policy = probing_policy()
    for tokens in (64, 1024):
        policy.record_eager_call("local", tokens, 0.012)
    see(policy, "a", eager_s=0.012, size=1024, tokens=600)
    assert see(policy, "a", size=1024, tokens=600) == WAIT
    policy.record_gpu_work("a", tokens=600, seconds=0.009)
    assert see(policy, "a", size=1024, tokens=600) == NO_GAIN
    assert policy.estimates("a")["graph_ratio"] == pytest.approx(0.009 / 600 * 1024 / 0.012)


def test_no_probe_is_asked_for_when_not_even_a_free_graph_would_pay():
    policy = probing_policy(expected_calls=3, repay_runs=1)
    see(policy, "a", eager_s=0.004)
    assert see(policy, "a") == WAIT
    assert not policy.wants_gpu_work("a")


def test_a_probe_that_measured_nothing_leaves_the_estimate_to_the_prior():
    policy = probing_policy()
    see(policy, "a", eager_s=0.004)
    assert see(policy, "a") == WAIT and policy.wants_gpu_work("a")
    policy.probing_gpu_work("a")
    policy.gpu_work_unmeasured("a")
    assert see(policy, "a") == CAPTURE
    assert policy.estimates("a")["graph_ratio"] == pytest.approx(PRIOR_GRAPH_RATIO)


def test_a_probe_is_paid_from_the_run_allowance():
    # A 20-call run repays a capture itself, but its allowance (3% of 80 ms)
    # cannot hold a probe (1.5 eager runs, 6 ms): the prior decides at once.
    assert HOLD_MARGIN * 0.004 > RUN_SLACK * 20 * 0.004
    policy = probing_policy(expected_calls=20)
    see(policy, "a", eager_s=0.004)
    assert see(policy, "a") == CAPTURE
    assert not policy.wants_gpu_work("a")
    # A long run can hold it, and what the probe may cost is taken from the allowance.
    policy = probing_policy(expected_calls=1000)
    see(policy, "a", eager_s=0.004)
    assert see(policy, "a") == WAIT
    allowance = policy.run_allowance()
    policy.probing_gpu_work("a")
    assert policy.run_allowance() == pytest.approx(allowance - HOLD_MARGIN * 0.004)


def test_compiled_graphs_and_callers_that_cannot_probe_do_not_wait():
    for policy in (probing_policy(graphs_fuse_work=True), CapturePolicy(min_sightings=2)):
        policy.begin_run(expected_calls=1000)
        see(policy, "a", eager_s=0.004)
        assert see(policy, "a") == CAPTURE
        assert not policy.wants_gpu_work("a")


def first_hits(manager, inputs, calls: int) -> int:
    """The call (1-based) of the first replay, or 0 when none replayed."""
    for call in range(1, calls + 1):
        run_calls(manager, inputs, 1)
        if manager.stats.hits:
            return call
    return 0


def test_manager_probes_before_its_first_capture_and_falls_back_when_probes_measure_nothing():
    # Without CUDA a probe's time is not the GPU's work, so it records nothing:
    # after that one probe the prior decides, as without probes.
    _, plain, inputs, _ = toy_manager(drop_slower_graphs=False)
    plain.begin_run(expected_calls=10_000)
    assert first_hits(plain, inputs, 10) == 2
    _, probing, inputs, expected = toy_manager(drop_slower_graphs=False)
    probing.policy.measures_gpu_work = True
    probing.begin_run(expected_calls=10_000)
    assert first_hits(probing, inputs, 10) == 3
    torch.testing.assert_close(run_calls(probing, inputs, 1)[0], expected)


@pytest.fixture
def probes_measure(monkeypatch):
    """``probes_measure(seconds)``: CallTimer's held runs record ``seconds``, as a
    probe on a GPU would, and are counted in the returned list."""

    def install(seconds: float) -> list[float]:
        holds: list[float] = []
        timed = CallTimer.timed

        @contextlib.contextmanager
        def probed_timed(self, record, hold_gpu_seconds=0.0):
            if not hold_gpu_seconds:
                with timed(self, record) as timing:
                    yield timing
                return
            holds.append(hold_gpu_seconds)
            yield Timing(on_cuda=True)
            record(seconds)

        monkeypatch.setattr(CallTimer, "timed", probed_timed)
        return holds

    return install


@pytest.mark.parametrize("gpu_seconds, captured", [(1e-9, True), (1.0, False)])
def test_manager_follows_what_a_probe_measured(probes_measure, gpu_seconds, captured):
    # Call 1 is timed, call 2 probes (held by the launch time of call 1); a
    # probe measuring next to nothing captures at call 3, a second never.
    holds = probes_measure(gpu_seconds)
    _, manager, inputs, expected = toy_manager(drop_slower_graphs=False)
    manager.policy.measures_gpu_work = True
    manager.begin_run(expected_calls=100)
    outputs = run_calls(manager, inputs, 6)
    assert len(holds) == 1 and holds[0] > 0
    assert manager.is_captured() is captured
    assert manager.stats.hits == (4 if captured else 0)
    for output in outputs:
        torch.testing.assert_close(output, expected)
