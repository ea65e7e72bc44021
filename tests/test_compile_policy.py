"""CompilePolicy (``compile="auto"``): when a run repays the compile, from injected
call times, and the manager's switch to compiled graphs."""

import functools
import logging
import random

import pytest
import torch
from toy_encoder import ToyEncoder, ToyTower

import lightning_cg.compiled as compiled_module
from lightning_cg.adapters.batched import BatchedEncoderAdapter
from lightning_cg.budgets import generate_budgets
from lightning_cg.compile_policy import (
    COMPILE_GAIN_PRIOR,
    COMPILE_SECONDS_PRIOR,
    MIN_SAMPLES,
    TIMING_STRIDE,
    WINDOW,
    CompilePolicy,
)
from lightning_cg.compiled import CompiledEncoder
from lightning_cg.manager import EncoderGraphManager
from lightning_cg.replay import relative_error


def timed(policy: CompilePolicy, seconds: float, calls: int = MIN_SAMPLES) -> CompilePolicy:
    for _ in range(calls):
        policy.record_call(seconds)
    return policy


def test_nothing_is_decided_before_enough_calls_are_timed():
    policy = timed(CompilePolicy(compile_seconds=1.0), 10.0, calls=MIN_SAMPLES - 1)
    assert not decide(policy, horizon_calls=10**6)
    policy.record_call(10.0)
    assert decide(policy, horizon_calls=10**6)


def decide(
    policy: CompilePolicy,
    horizon_calls: float,
    capture_seconds: float = 0.0,
    committed_calls: float | None = None,
    allowance: float = 0.0,
) -> bool:
    """``policy.decide``; the calls known to come are the horizon unless given."""
    committed = horizon_calls if committed_calls is None else committed_calls
    return policy.decide(horizon_calls, capture_seconds, committed, allowance)


def timed_policy(compile_seconds: float, seconds: float, gain: float = 0.25) -> CompilePolicy:
    """A policy after calls of ``seconds``."""
    return timed(CompilePolicy(compile_seconds, gain=gain), seconds)


def test_the_horizon_compiles_when_its_calls_repay_the_compile():
    # 0.1 s calls save a quarter each: 240 calls repay a 6 s compile.
    # Anything may be paid ahead here: the horizon alone decides.
    ahead = {"committed_calls": 0, "allowance": float("inf")}
    assert not decide(timed_policy(6.0, 0.1), horizon_calls=239, **ahead)
    assert decide(timed_policy(6.0, 0.1), horizon_calls=240, **ahead)
    # The gain scales what a call saves: at 0.5, 120 calls do.
    assert decide(timed_policy(6.0, 0.1, gain=0.5), horizon_calls=120, **ahead)
    assert CompilePolicy(6.0).gain == COMPILE_GAIN_PRIOR


@pytest.mark.parametrize("allowance, compiles", [(0.99, False), (1.0, True)])
def test_what_the_calls_known_to_come_leave_unpaid_must_fit_the_allowance(allowance, compiles):
    # 0.1 s calls save 0.025 s each: the horizon's 400 calls repay a 6 s
    # compile; the 200 calls known to come repay 5 s of it.
    policy = timed_policy(6.0, 0.1)
    decided = decide(policy, horizon_calls=400, committed_calls=200, allowance=allowance)
    assert decided is compiles
    assert policy.overrun_seconds == (None if compiles else pytest.approx(1.0 - allowance))


def test_no_overrun_is_told_when_the_horizon_does_not_repay_the_compile():
    policy = timed_policy(6.0, 0.1)
    assert not decide(policy, horizon_calls=239, committed_calls=0)
    assert policy.overrun_seconds is None


def test_graphs_to_capture_again_raise_the_bar():
    policy = timed_policy(6.0, 0.1)
    assert not decide(policy, horizon_calls=240, capture_seconds=1.0)
    assert decide(policy, horizon_calls=280, capture_seconds=1.0)


def test_quick_calls_never_compile_in_a_run_of_known_length():
    policy = timed(CompilePolicy(6.0), 0.001)  # 1 ms calls: 20,000 calls repay
    assert not decide(policy, horizon_calls=8_000)


def test_the_decision_is_taken_once_and_timing_stops():
    policy = timed(CompilePolicy(6.0), 1.0)
    assert decide(policy, horizon_calls=100)
    assert policy.compiling
    assert not decide(policy, horizon_calls=100)
    assert not policy.wants_call_timing()


def test_after_the_first_samples_one_call_in_a_stride_is_timed():
    policy = CompilePolicy(6.0)
    wanted = []
    for _ in range(MIN_SAMPLES + 4 * TIMING_STRIDE):
        wanted.append(policy.wants_call_timing())
        if wanted[-1]:
            policy.record_call(0.01)
    assert all(wanted[:MIN_SAMPLES])
    assert sum(wanted[MIN_SAMPLES:]) == 4


def test_recent_calls_decide():
    # Heavy calls of an earlier run, then quick ones: the window forgets the former.
    policy = timed(CompilePolicy(6.0), 1.0, calls=WINDOW)
    timed(policy, 0.001, calls=WINDOW)
    assert not decide(policy, horizon_calls=2000)


# ------------------------------------------------------------- the manager


def eager_backend(monkeypatch, backend="eager") -> None:
    """Compile with dynamo's ``backend`` (eager: traces, generates no code)."""
    monkeypatch.setattr(
        compiled_module, "CompiledEncoder", functools.partial(CompiledEncoder, backend=backend)
    )


def calls(manager: EncoderGraphManager, tower: ToyTower, count: int, seed: int = 0) -> None:
    """``count`` calls of two items each, every output compared with the tower's."""
    rng = random.Random(seed)
    with torch.no_grad():
        for _ in range(count):
            lengths = torch.tensor([rng.randrange(1, 40) for _ in range(2)])
            tokens = torch.randn(int(lengths.sum()), 8)
            actual = manager.execute(manager.encoder.inputs_from_call((tokens, lengths), {}))
            assert relative_error(actual, tower(tokens, lengths)) < 1e-5


def test_auto_is_the_default_and_waits_uncompiled(monkeypatch):
    eager_backend(monkeypatch)
    tower = ToyTower().eval()
    manager = EncoderGraphManager(ToyEncoder(tower), capture="first_use")
    assert manager.config.compile == "auto"
    assert manager.compiled_encoder is not None and not manager.compiled_encoder.started
    manager.begin_run(expected_calls=10)
    calls(manager, tower, 10)
    # On the CPU no call is timed for the policy, so nothing compiles.
    assert manager.stats.hits > 0 and manager.stats.compile_seconds == 0.0
    assert manager.compile_policy.estimates()["timed_calls"] == 0


def test_a_run_that_repays_the_compile_switches_to_compiled_graphs(monkeypatch):
    eager_backend(monkeypatch)
    tower = ToyTower().eval()
    manager = EncoderGraphManager(ToyEncoder(tower), capture="first_use")
    manager.begin_run(expected_calls=1000)
    calls(manager, tower, 3)
    assert len(manager.cache) > 0 and manager.weight_casts is not None
    # Calls timed at 1 s each: 997 remaining calls save far more than 6-45 s.
    timed(manager.compile_policy, 1.0)
    calls(manager, tower, 3, seed=1)
    assert manager.compiled_encoder.started and manager.compile_policy is None
    # The keys held before were prepared again, over the compiled forward.
    assert manager.stats.compile_seconds > 0 and len(manager.cache) > 0
    assert manager.weight_casts is None and manager.policy.costs.graphs_fuse_work


def test_a_short_run_stays_uncompiled(monkeypatch):
    eager_backend(monkeypatch)
    tower = ToyTower().eval()
    manager = EncoderGraphManager(ToyEncoder(tower), capture="first_use")
    manager.begin_run(expected_calls=8)
    timed(manager.compile_policy, 1.0)  # two runs of 8 calls save 16 x 0.3 s < 45 s
    calls(manager, tower, 8)
    assert not manager.compiled_encoder.started and manager.stats.compile_seconds == 0.0


@pytest.mark.parametrize("repay_runs", [2, 3])
def test_later_runs_that_may_never_come_do_not_make_this_run_compile(
    monkeypatch, caplog, repay_runs
):
    caplog.set_level(logging.INFO, logger="lightning_cg.compiling")
    eager_backend(monkeypatch)
    tower = ToyTower().eval()
    manager = EncoderGraphManager(ToyEncoder(tower), capture="first_use", repay_runs=repay_runs)
    # The toy's whole dynamic forward: a 45 s compile. 12 calls x 3 s saved:
    # 36 s in this run, 72 s or more with the runs repay_runs counts on; but
    # those may never come, and this run would pay the 9 s they leave.
    assert manager.compile_policy.compile_seconds == 45.0
    manager.begin_run(expected_calls=12)
    timed(manager.compile_policy, 10.0)
    calls(manager, tower, 2)
    assert manager.compile_policy.estimates()["timed_calls"] >= MIN_SAMPLES
    assert not manager.compiled_encoder.started
    # The user is told once why, and what would compile.
    messages = [record.getMessage() for record in caplog.records]
    told = [message for message in messages if "not compiling" in message]
    assert len(told) == 1 and "compile=true" in told[0]


@pytest.mark.parametrize("later_runs, compiles", [(None, False), (0, False), (3, True)])
def test_runs_known_to_follow_count_when_they_are_more(monkeypatch, later_runs, compiles):
    eager_backend(monkeypatch)
    tower = ToyTower().eval()
    manager = EncoderGraphManager(ToyEncoder(tower), capture="first_use", repay_runs=1)
    # 12 calls x 3 s saved: 36 s in this run, 144 s with 3 more like it (45 s compile).
    manager.begin_run(expected_calls=12, later_runs=later_runs)
    timed(manager.compile_policy, 10.0)
    calls(manager, tower, 2)
    assert manager.compiled_encoder.started is compiles


def test_a_failed_compile_warns_and_keeps_the_uncompiled_forward(monkeypatch):
    def failing_backend(graph_module, example_inputs):
        raise RuntimeError("no compiler here")

    eager_backend(monkeypatch, failing_backend)
    tower = ToyTower().eval()
    manager = EncoderGraphManager(ToyEncoder(tower), capture="first_use")
    manager.start_compiling()
    with pytest.warns(RuntimeWarning, match="no compiler here"):
        calls(manager, tower, 5)
    assert "no compiler here" in manager.compiled_encoder.compile_error
    assert not manager.compiled_encoder.started and manager.stats.hits > 0
    assert not manager.policy.costs.graphs_fuse_work  # the graphs are uncompiled again
    # The call after the failure brought back the uncompiled ladder and weight copies.
    assert manager.paths["local"].budgets == [8, 16, 32, 64]
    assert manager.weight_casts is not None
    graphs = len(manager.cache)
    manager.start_compiling()  # given up for good: nothing changes
    assert len(manager.cache) == graphs and not manager.compiled_encoder.started


def test_compile_true_raises_a_failed_compile(monkeypatch):
    def failing_backend(graph_module, example_inputs):
        raise RuntimeError("no compiler here")

    eager_backend(monkeypatch, failing_backend)
    tower = ToyTower().eval()
    manager = EncoderGraphManager(ToyEncoder(tower), capture="first_use", compile=True)
    assert manager.compile_policy is None and manager.compiled_encoder.started
    with pytest.raises(Exception, match="no compiler here"):
        calls(manager, tower, 1)


def miscompiling_backend(graph_module, example_inputs):
    """A backend whose code gives every float output 1.5 times too large."""

    def run(*args):
        outputs = graph_module(*args)
        return type(outputs)(
            output * 1.5
            if isinstance(output, torch.Tensor) and output.is_floating_point()
            else output
            for output in outputs
        )

    return run


@pytest.mark.parametrize("compile_", ["auto", True])
def test_a_compiled_graph_that_differs_from_eager_ends_compiling(monkeypatch, compile_):
    eager_backend(monkeypatch, miscompiling_backend)
    tower = ToyTower().eval()
    manager = EncoderGraphManager(ToyEncoder(tower), capture="first_use", compile=compile_)
    manager.start_compiling()
    with pytest.warns(RuntimeWarning, match="differs from eager by relative error"):
        calls(manager, tower, 5)  # every output equal to the tower's, the first call's too
    assert not manager.compiled_encoder.started
    assert "relative error" in manager.compiled_encoder.compile_error
    # The uncompiled forward serves from then on, with its weight copies and ladder.
    assert manager.stats.hits > 0 and len(manager.cache) > 0
    assert not manager.policy.costs.graphs_fuse_work and manager.weight_casts is not None
    assert manager.paths["local"].budgets == [8, 16, 32, 64]


# The toy's local path spans budgets 8..64.
FINE_LADDER = generate_budgets(8, 64, "geometric", 1.05, 16)


def test_compiled_graphs_get_a_finer_ladder(monkeypatch):
    eager_backend(monkeypatch)
    tower = ToyTower().eval()
    manager = EncoderGraphManager(ToyEncoder(tower), capture="first_use")
    assert manager.paths["local"].budgets == [8, 16, 32, 64]
    calls(manager, tower, 3)
    manager.start_compiling()
    assert manager.paths["local"].budgets == FINE_LADDER != [8, 16, 32, 64]
    calls(manager, tower, 5, seed=1)  # outputs still equal the tower's
    keys = {key.descriptor.num_tokens for key in manager.cache.keys()}
    assert keys <= set(FINE_LADDER) and keys - {8, 16, 32, 64}
    # compile=True plans the fine ladder from the start.
    compiled = EncoderGraphManager(ToyEncoder(tower), compile=True)
    assert compiled.paths["local"].budgets == FINE_LADDER


@pytest.mark.parametrize(
    "budgets",
    [{"budgets": [8, 32, 64]}, {"compiled_ratio": None}, {"ladder": "geometric", "ratio": 1.02}],
)
def test_explicit_fine_or_opted_out_ladders_stay_when_compiling(monkeypatch, budgets):
    eager_backend(monkeypatch)
    manager = EncoderGraphManager(ToyEncoder(ToyTower().eval()), budgets=budgets)
    before = list(manager.paths["local"].budgets)
    manager.start_compiling()
    assert manager.compiled_encoder.started and manager.paths["local"].budgets == before


def test_measured_dispatch_keeps_its_ladder_when_compiling(monkeypatch):
    # Measured dispatch captures and times a path's whole ladder: a finer one
    # would multiply its captures (64..4096 tokens: 62 budgets instead of 7).
    eager_backend(monkeypatch)
    manager = EncoderGraphManager(ToyEncoder(ToyTower().eval()), dispatch="measured")
    manager.start_compiling()
    assert manager.compiled_encoder.started
    assert manager.paths["local"].budgets == [8, 16, 32, 64]


def test_static_shapes_keep_their_ladder_when_compiling():
    # A batch-first tower compiles each batch size: more budgets, more compiles.
    tower = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 4)).eval()
    manager = EncoderGraphManager(BatchedEncoderAdapter(tower, max_batch_size=8))
    before = {path: list(plan.budgets) for path, plan in manager.paths.items()}
    manager.start_compiling()
    assert manager.compiled_encoder.started
    assert {path: plan.budgets for path, plan in manager.paths.items()} == before


def test_compiled_graphs_that_equal_eager_are_kept(monkeypatch):
    eager_backend(monkeypatch)
    tower = ToyTower().eval()
    manager = EncoderGraphManager(ToyEncoder(tower), capture="first_use", compile=True)
    calls(manager, tower, 5)
    assert manager.compiled_encoder.started and manager.compiled_encoder.compile_error is None
    assert all(graph.verified for graph in manager.cache.graphs())


@pytest.mark.parametrize("options", [{"compile": False}, {"mode": "piecewise"}, {"mode": "none"}])
def test_nothing_compiles_without_compile_or_full_graphs(options):
    manager = EncoderGraphManager(ToyEncoder(ToyTower().eval()), **options)
    assert manager.compiled_encoder is None and manager.compile_policy is None
    with pytest.raises(RuntimeError, match="start_compiling needs compile=True or 'auto'"):
        manager.start_compiling()


@pytest.mark.cuda
def test_cuda_calls_timed_on_the_gpu_start_the_compile_and_outputs_stay_eager(monkeypatch):
    # A free compile and a run long enough to repay the captures again: the GPU
    # timings of the first calls alone decide.
    eager_backend(monkeypatch)
    for compiles in COMPILE_SECONDS_PRIOR:
        monkeypatch.setitem(COMPILE_SECONDS_PRIOR, compiles, 0.0)
    tower = ToyTower().cuda().eval()
    manager = EncoderGraphManager(ToyEncoder(tower), capture="first_use")
    manager.begin_run(expected_calls=10**9)
    rng = random.Random(0)
    with torch.no_grad():
        for call in range(3 * MIN_SAMPLES):
            lengths = torch.tensor([rng.randrange(1, 40) for _ in range(2)])
            tokens = torch.randn(int(lengths.sum()), 8, device="cuda")
            actual = manager.execute(manager.encoder.inputs_from_call((tokens, lengths), {}))
            assert relative_error(actual, tower(tokens, lengths)) < 1e-5, call
    assert manager.compiled_encoder.started and manager.stats.compile_seconds > 0
    assert manager.stats.graphs_captured > 0


def test_nothing_is_compiled_or_wrapped_before_compiling_starts(monkeypatch):
    # torch.compile's first call imports dynamo (seconds): a run that never
    # compiles must not pay it.
    compiled = []

    def recording_compile(function, **options):
        compiled.append(function)
        return function

    monkeypatch.setattr(torch, "compile", recording_compile)
    tower = ToyTower().eval()
    manager = EncoderGraphManager(ToyEncoder(tower), capture="first_use")
    calls(manager, tower, 3)
    assert compiled == []
    manager.start_compiling()
    calls(manager, tower, 1)
    assert len(compiled) == 1
