"""CompileLifecycle (``compile=True``): compiled plans from the start, the check of
compiled graphs against eager, and the uncompiled plans back when compiling is
given up (between calls only)."""

import functools
import random

import pytest
import torch
from toy_encoder import ToyEncoder, ToyTower

import lightning_cg.engine.compiled as compiled_module
from lightning_cg.adapters.batched import BatchedEncoderAdapter
from lightning_cg.core.budgets import generate_budgets
from lightning_cg.engine.compiled import CompiledEncoder
from lightning_cg.engine.manager import EncoderGraphManager
from lightning_cg.engine.replay import relative_error

UNCOMPILED_LADDER = [8, 16, 32, 64]  # the toy's local path, pow2
# The toy's local path spans budgets 8..64.
FINE_LADDER = generate_budgets(8, 64, "geometric", 1.05, 16)


def eager_backend(monkeypatch, backend="eager") -> None:
    """Compile with dynamo's ``backend`` (eager: traces, generates no code)."""
    monkeypatch.setattr(
        compiled_module, "CompiledEncoder", functools.partial(CompiledEncoder, backend=backend)
    )


def call(manager: EncoderGraphManager) -> None:
    """One call of one 30-token item, through the graphs."""
    with torch.no_grad():
        manager.execute(
            manager.encoder.inputs_from_call((torch.randn(30, 8), torch.tensor([30])), {})
        )


def calls(manager: EncoderGraphManager, tower: ToyTower, count: int, seed: int = 0) -> None:
    """``count`` calls of two items each, every output compared with the tower's."""
    rng = random.Random(seed)
    device = next(tower.parameters()).device
    with torch.no_grad():
        for _ in range(count):
            lengths = torch.tensor([rng.randrange(1, 40) for _ in range(2)])
            tokens = torch.randn(int(lengths.sum()), 8, device=device)
            actual = manager.execute(manager.encoder.inputs_from_call((tokens, lengths), {}))
            assert relative_error(actual, tower(tokens, lengths)) < 1e-5


def test_giving_up_restores_the_uncompiled_plans_at_the_next_call(monkeypatch):
    eager_backend(monkeypatch)
    manager = EncoderGraphManager(ToyEncoder(ToyTower().eval()), capture="first_use", compile=True)
    call(manager)
    compiled_ladder = list(manager.paths["local"].budgets)
    assert compiled_ladder != UNCOMPILED_LADDER and len(manager.cache) > 0

    compiling = manager.compiling
    with pytest.warns(RuntimeWarning, match="a failed compile"):
        compiling.compiled_encoder.give_up("a failed compile")
    # A compile fails inside a capture: what is checked and expected changes now,
    # the plans and graphs stay until the next call.
    assert manager.runner.on_compiled_mismatch is None and not manager.policy.graphs_fuse_work
    assert list(manager.paths["local"].budgets) == compiled_ladder and manager.weight_casts is None
    assert len(manager.cache) > 0

    compiling.before_call()
    assert list(manager.paths["local"].budgets) == UNCOMPILED_LADDER
    assert manager.weight_casts is not None and len(manager.cache) == 0
    call(manager)
    compiling.before_call()  # once only: the uncompiled graphs captured since stay
    assert len(manager.cache) > 0


def test_compile_true_plans_compiled_graphs_from_the_first_capture(monkeypatch):
    eager_backend(monkeypatch)
    tower = ToyTower().eval()
    manager = EncoderGraphManager(ToyEncoder(tower), capture="first_use", compile=True)
    assert manager.compiled_encoder.started
    # No weight copies (their dtype would recompile), fused work expected.
    assert manager.weight_casts is None and manager.policy.graphs_fuse_work
    calls(manager, tower, 3)
    assert manager.stats.compile_seconds > 0 and len(manager.cache) > 0


def test_compile_true_raises_a_failed_compile(monkeypatch):
    def failing_backend(graph_module, example_inputs):
        raise RuntimeError("no compiler here")

    eager_backend(monkeypatch, failing_backend)
    tower = ToyTower().eval()
    manager = EncoderGraphManager(ToyEncoder(tower), capture="first_use", compile=True)
    assert manager.compiled_encoder.started
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


def test_a_compiled_graph_that_differs_from_eager_ends_compiling(monkeypatch):
    eager_backend(monkeypatch, miscompiling_backend)
    tower = ToyTower().eval()
    manager = EncoderGraphManager(ToyEncoder(tower), capture="first_use", compile=True)
    with pytest.warns(RuntimeWarning, match="differs from eager by relative error"):
        calls(manager, tower, 1)  # its one sub-batch served by eager rows, not the graph's
    assert (manager.stats.hits, manager.stats.eager_compiled_mismatch) == (0, 1)
    calls(manager, tower, 4)  # every output equal to the tower's
    assert manager.stats.eager_compiled_mismatch == 1
    assert not manager.compiled_encoder.started
    assert "relative error" in manager.compiled_encoder.compile_error
    # The uncompiled forward serves from then on, with its weight copies and ladder.
    assert manager.stats.hits > 0 and len(manager.cache) > 0
    assert not manager.policy.graphs_fuse_work and manager.weight_casts is not None
    assert list(manager.paths["local"].budgets) == UNCOMPILED_LADDER


def test_compiled_graphs_get_a_finer_ladder(monkeypatch):
    eager_backend(monkeypatch)
    tower = ToyTower().eval()
    assert list(EncoderGraphManager(ToyEncoder(tower)).paths["local"].budgets) == UNCOMPILED_LADDER
    manager = EncoderGraphManager(ToyEncoder(tower), capture="first_use", compile=True)
    assert list(manager.paths["local"].budgets) == FINE_LADDER != UNCOMPILED_LADDER
    calls(manager, tower, 5, seed=1)  # outputs still equal the tower's
    keys = {key.descriptor.num_tokens for key in manager.cache.keys()}
    assert keys <= set(FINE_LADDER) and keys - set(UNCOMPILED_LADDER)


def local_budgets(**options) -> list[int]:
    return list(
        EncoderGraphManager(ToyEncoder(ToyTower().eval()), **options).paths["local"].budgets
    )


@pytest.mark.parametrize(
    "budgets",
    [{"budgets": [8, 32, 64]}, {"ladder": "geometric", "ratio": 1.02}],
)
def test_explicit_or_fine_ladders_stay_when_compiling(monkeypatch, budgets):
    eager_backend(monkeypatch)
    assert local_budgets(budgets=budgets, compile=True) == local_budgets(budgets=budgets)


def test_static_shapes_keep_their_ladder_when_compiling():
    # A batch-first tower compiles each batch size: more budgets, more compiles.
    tower = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 4)).eval()

    def ladders(**options) -> dict[str, list[int]]:
        manager = EncoderGraphManager(BatchedEncoderAdapter(tower, max_batch_size=8), **options)
        return {path: list(plan.budgets) for path, plan in manager.paths.items()}

    assert ladders(compile=True) == ladders()


def test_compiled_graphs_that_equal_eager_are_kept(monkeypatch):
    eager_backend(monkeypatch)
    tower = ToyTower().eval()
    manager = EncoderGraphManager(ToyEncoder(tower), capture="first_use", compile=True)
    calls(manager, tower, 5)
    assert manager.compiled_encoder.started and manager.compiled_encoder.compile_error is None
    assert all(graph.checks.passed for graph in manager.cache.graphs())


@pytest.mark.parametrize("options", [{}, {"compile": False}, {"mode": "none"}])
def test_nothing_compiles_unless_compile_is_true(options):
    manager = EncoderGraphManager(ToyEncoder(ToyTower().eval()), **options)
    assert manager.config.compile is False and manager.compiled_encoder is None
    assert manager.compiling is None  # nothing checks or replans compiled graphs
    assert not manager.policy.graphs_fuse_work


def test_nothing_is_compiled_before_the_first_graph_forward(monkeypatch):
    # torch.compile's first call imports dynamo (seconds): a manager whose
    # calls all run eagerly must not pay it.
    compiled = []

    def recording_compile(function, **options):
        compiled.append(function)
        return function

    monkeypatch.setattr(torch, "compile", recording_compile)
    tower = ToyTower().eval()
    manager = EncoderGraphManager(ToyEncoder(tower), capture="first_use", compile=True)
    with torch.enable_grad():  # calls that need gradients run eagerly
        manager.execute(
            manager.encoder.inputs_from_call((torch.randn(30, 8), torch.tensor([30])), {})
        )
    assert compiled == []
    calls(manager, tower, 1)
    assert len(compiled) == 1


@pytest.mark.cuda
def test_cuda_compiled_graphs_are_captured_and_outputs_stay_eager(monkeypatch):
    eager_backend(monkeypatch)
    tower = ToyTower().cuda().eval()
    manager = EncoderGraphManager(ToyEncoder(tower), capture="first_use", compile=True)
    calls(manager, tower, 8)
    assert manager.compiled_encoder.started and manager.stats.compile_seconds > 0
    assert manager.stats.graphs_captured > 0
