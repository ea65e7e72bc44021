"""Capture faults: out of memory keeps the budgets that fit, a tower a graph cannot hold
runs eagerly, a replay that reads a stale Python scalar is caught at its first check."""

import random
import warnings

import pytest
import torch
from test_callback import BUDGETS as CALLBACK_BUDGETS
from test_callback import predictions
from test_manager import make_batch, run
from toy_encoder import ToyEncoder, ToyTower

import lightning_cg.engine.capture as capture_module
from lightning_cg.adapters.packed import PackedEncoderAdapter
from lightning_cg.callback.graph_callback import CUDAGraphCallback
from lightning_cg.engine.faults import (
    OUT_OF_MEMORY,
    UNCAPTURABLE,
    CaptureError,
    capturing,
    diagnose,
    is_out_of_memory,
)
from lightning_cg.engine.manager import BudgetConfig, EncoderGraphManager
from lightning_cg.engine.replay import relative_error

BUDGETS = BudgetConfig(budgets=[8, 16, 32, 64])
HOST_SYNC = (
    "CUDA error: operation not permitted when stream is capturing\n"
    "Search for `cudaErrorStreamCaptureUnsupported' in the CUDA docs"
)
CAPTURE_INVALIDATED = "CUDA error: operation failed due to a previous error during capture"


def out_of_memory() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def chained(error: BaseException, context: BaseException) -> BaseException:
    """``error`` raised while handling ``context``, as ``torch.cuda.graph`` raises them."""
    try:
        try:
            raise context
        except BaseException:
            raise error  # noqa: B904 -- the implicit context is the point
    except BaseException as raised:
        return raised


class FailingEncoder(ToyEncoder):
    """Raises ``error()`` from ``capture_inputs`` for the keys ``fails(spec)`` picks.

    Without CUDA, capture_inputs is where a capture allocates; the manager's
    handling is the same whichever step of the capture raised.
    """

    def __init__(self, tower, fails, error) -> None:
        super().__init__(tower, max_budget=64)
        self.fails, self.error = fails, error
        self.captured: list[tuple[str, int]] = []

    def capture_inputs(self, spec):
        self.captured.append((spec.path, spec.token_budget))
        if self.fails(spec):
            raise self.error()
        return super().capture_inputs(spec)


def messages(caught, text: str) -> list[str]:
    return [str(w.message) for w in caught if text in str(w.message)]


def run_and_compare(manager, tower, batches) -> None:
    for lengths in batches:
        tokens, lengths = make_batch(random.Random(len(lengths)), lengths)
        actual = run(manager, tokens, lengths)
        assert relative_error(actual, tower(tokens, lengths)) < 1e-5


# ------------------------------------------------------------ diagnosis


@pytest.mark.parametrize(
    ("error", "kind", "words"),
    [
        (out_of_memory(), OUT_OF_MEMORY, "out of device memory"),
        (RuntimeError("CUDA error: out of memory"), OUT_OF_MEMORY, "max_budget"),
        (RuntimeError(HOST_SYNC), UNCAPTURABLE, ".item()"),
        (
            chained(RuntimeError(CAPTURE_INVALIDATED), RuntimeError(HOST_SYNC)),
            UNCAPTURABLE,
            "move it out of the graphed forward into replay metadata",
        ),
        (chained(RuntimeError(CAPTURE_INVALIDATED), out_of_memory()), OUT_OF_MEMORY, "memory"),
        (
            RuntimeError(
                "Cannot copy between CPU and CUDA tensors during CUDA graph capture unless "
                "the CPU tensor is pinned."
            ),
            UNCAPTURABLE,
            "CPU op",
        ),
        (
            RuntimeError(
                "CUDA error: operation would make the legacy stream depend on a capturing "
                "blocking stream"
            ),
            UNCAPTURABLE,
            "static buffers",
        ),
        (
            RuntimeError("Could not guard on data-dependent expression Eq(u0, 4)"),
            UNCAPTURABLE,
            "depend on the data",
        ),
        (RuntimeError("aten.nonzero.default: dynamic shape operator"), UNCAPTURABLE, "torch.where"),
        (RuntimeError(CAPTURE_INVALIDATED), UNCAPTURABLE, "cannot hold"),
    ],
)
def test_diagnose_names_the_cause_and_the_fix(error, kind, words):
    fault = diagnose(error)
    assert fault is not None and fault.kind == kind
    assert words in f"{fault.cause} {fault.fix}"
    assert fault.error  # the line that said so


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("capture exploded"),
        RuntimeError("mat1 and mat2 must have the same dtype"),
        ValueError("grid_thw disagrees with pixel_patches"),
        KeyError("tokens"),
    ],
)
def test_diagnose_leaves_other_errors_alone(error):
    assert diagnose(error) is None


def raised_in_capture(error: BaseException) -> BaseException:
    try:
        with capturing():
            raise error
    except BaseException as raised:
        return raised


def test_an_error_inside_a_capture_is_the_captures_fault():
    raised = raised_in_capture(ValueError("index 3 is out of bounds"))
    assert isinstance(raised, CaptureError) and isinstance(raised.__cause__, ValueError)
    fault = diagnose(raised)
    assert fault.kind == UNCAPTURABLE and "cannot hold" in fault.cause
    assert fault.error == "ValueError: index 3 is out of bounds"
    # A message diagnose knows still names its own cause.
    assert ".item()" in diagnose(raised_in_capture(RuntimeError(HOST_SYNC))).cause


@pytest.mark.parametrize("error", [out_of_memory(), KeyboardInterrupt()])
def test_out_of_memory_and_interrupts_leave_a_capture_as_they_are(error):
    assert raised_in_capture(error) is error


def test_out_of_memory_is_recognised_by_type_and_message():
    assert is_out_of_memory(out_of_memory())
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert not is_out_of_memory(ValueError("out of memory"))  # not from the device
    assert not is_out_of_memory(RuntimeError(HOST_SYNC))


# -------------------------------------------------------- out of memory


def test_out_of_memory_keeps_the_budgets_below_the_failing_one(monkeypatch):
    freed = []
    free = capture_module.free_device_memory
    monkeypatch.setattr(capture_module, "free_device_memory", lambda: freed.append(free()))
    tower = ToyTower().eval()
    encoder = FailingEncoder(
        tower, lambda spec: (spec.path, spec.token_budget) == ("local", 32), out_of_memory
    )
    manager = EncoderGraphManager(encoder, budgets=BUDGETS, capture="first_use")
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # 12 tokens: budget 16; 30 tokens: 32 fails, so eager; 21 tokens: split
        # into sub-batches of budgets 16 and 8.
        run_and_compare(manager, tower, [[5, 7], [30], [3] * 7, [9]])
        manager.clear()  # what memory taught stays: 32 and 64 are not tried again
        run_and_compare(manager, tower, [[5, 7], [2, 2]])
    [warning] = messages(caught, "out of memory")
    assert "path 'local' at token budget 32" in warning and "[8, 16]" in warning
    # Each key when first needed: 16, then 32 failed (64 never tried), 8; after
    # clear() only 16 and 8 again.
    assert encoder.captured == [("local", b) for b in (16, 32, 8, 16, 8)]
    assert len(freed) == 1
    assert list(manager.paths["local"].budgets) == [8, 16]
    assert sorted(key.descriptor.num_tokens for key in manager.cache.keys()) == [8, 16]
    assert manager.stats.hits > 0 and manager.stats.misses > 0


def test_a_call_shape_seen_before_a_budget_was_dropped_is_packed_for_the_budgets_left():
    tower = ToyTower().eval()
    encoder = FailingEncoder(
        tower, lambda spec: (spec.path, spec.token_budget) == ("local", 32), out_of_memory
    )
    manager = EncoderGraphManager(encoder, budgets=BUDGETS, capture="first_use")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # 5 + 7 + 14 tokens: one sub-batch of budget 32, which runs out of memory.
        run_and_compare(manager, tower, [[5, 7, 14]])
        assert manager.stats.hits == 0
        # The same call again: two sub-batches within 16 tokens now, both replayed.
        run_and_compare(manager, tower, [[5, 7, 14]])
    assert manager.stats.hits == 2
    assert list(manager.paths["local"].budgets) == [8, 16]


def test_out_of_memory_at_every_budget_runs_the_path_eagerly_and_warns_once():
    tower = ToyTower(global_tokens=4).eval()
    encoder = FailingEncoder(tower, lambda spec: spec.path == "global", out_of_memory)
    manager = EncoderGraphManager(encoder, budgets=BUDGETS, capture="first_use")
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_and_compare(manager, tower, [[5, 7], [3, 3, 3], [9], [1, 2]])
    [warning] = messages(caught, "out of memory")
    assert "path 'global' at token budget 8" in warning  # the smallest: nothing left
    assert "path 'global' runs eagerly" in warning
    assert {key.path for key in manager.cache.keys()} == {"local"}
    assert manager.paths["global"].eager_reason is not None
    # Every sub-batch: local from a graph, global eagerly.
    assert manager.stats.hits == manager.stats.misses == manager.stats.sub_batches


def test_the_callback_keeps_the_budgets_that_fit(monkeypatch):
    capture_inputs = PackedEncoderAdapter.capture_inputs

    def failing(self, spec):
        if spec.token_budget >= 32:
            raise out_of_memory()
        return capture_inputs(self, spec)

    monkeypatch.setattr(PackedEncoderAdapter, "capture_inputs", failing)
    callback = CUDAGraphCallback(budgets=CALLBACK_BUDGETS, capture="first_use")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphed = predictions(callback)
    found = messages(caught, "out of memory")
    # One warning per key that failed when first needed, each naming what is kept.
    assert found and all("path 'local' at token budget" in warning for warning in found)
    assert not messages(caught, "capturing graphs failed")  # the rank did not turn eager
    assert callback.manager.capture_error is None and callback.last_stats["hits"] > 0
    assert list(callback.manager.paths["local"].budgets) == [8, 16]
    monkeypatch.undo()
    torch.testing.assert_close(graphed, predictions(), rtol=1e-5, atol=1e-6)


# ------------------------------------------------ towers a graph cannot hold


def test_an_uncapturable_tower_runs_eagerly_with_the_cause_and_the_fix():
    tower = ToyTower(global_tokens=4).eval()
    encoder = FailingEncoder(tower, lambda spec: True, lambda: RuntimeError(HOST_SYNC))
    manager = EncoderGraphManager(encoder, budgets=BUDGETS, capture="first_use")
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_and_compare(manager, tower, [[5, 7], [3, 3, 3], [9]])
        manager.clear()
        run_and_compare(manager, tower, [[4, 4]])
    found = messages(caught, "runs eagerly")
    assert len(found) == 2  # once per path, never again
    for path, warning in zip(("local", "global"), found, strict=True):
        assert f"capturing path {path!r} failed" in warning
        assert ".item()" in warning and "replay metadata" in warning
    # One attempt per path, at the first key each needed.
    assert encoder.captured == [("local", 16), ("global", 8)]
    assert not manager.is_captured() and manager.stats.hits == 0


def test_an_unknown_capture_error_runs_every_path_eagerly_from_then_on():
    tower = ToyTower(global_tokens=4).eval()
    encoder = FailingEncoder(tower, lambda spec: True, lambda: RuntimeError("capture exploded"))
    manager = EncoderGraphManager(encoder, budgets=BUDGETS, capture="first_use")
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_and_compare(manager, tower, [[5, 7], [3, 3, 3]])  # the call that failed too
    [warning] = messages(caught, "capturing graphs failed")
    assert "capture exploded" in warning and "every path runs eagerly" in warning
    assert "capture exploded" in manager.capture_error
    assert all(plan.eager_reason for plan in manager.paths.values())
    assert encoder.captured == [("local", 16)]  # no attempt after the first failure
    assert not manager.is_captured() and manager.stats.hits == 0


def test_the_callback_runs_eagerly_after_an_unknown_capture_error(monkeypatch):
    def exploding(self, spec):
        raise RuntimeError("capture exploded")

    monkeypatch.setattr(PackedEncoderAdapter, "capture_inputs", exploding)
    callback = CUDAGraphCallback(budgets=CALLBACK_BUDGETS, capture="first_use")
    with pytest.warns(RuntimeWarning, match="capture exploded"):
        graphed = predictions(callback)
    assert callback.last_stats["hits"] == 0 and callback.last_stats["items"] == 12
    assert "capture exploded" in callback.manager.capture_error
    monkeypatch.undo()
    torch.testing.assert_close(graphed, predictions(), rtol=1e-5, atol=1e-6)


class ScaleCachingTower(ToyTower):
    """Its body scales by a Python float that only its eager forward sets."""

    scale = 1.0

    def body(self, tokens, cu_seqlens):
        return super().body(tokens, cu_seqlens) * self.scale


class ScaleCachingEncoder(ToyEncoder):
    def eager_forward(self, path, inputs):
        # What the tower's eager forward does: read a statistic of the batch on the host.
        self.tower.scale = 1.0 + inputs.tokens.abs().mean().item()
        return super().eager_forward(path, inputs)


def test_a_tower_that_reads_a_stale_python_scalar_is_caught_at_the_first_replay():
    tower = ScaleCachingTower().eval()
    manager = EncoderGraphManager(ScaleCachingEncoder(tower), budgets=BUDGETS, capture="first_use")
    tokens, lengths = make_batch(random.Random(0), [5, 6])
    inputs = manager.encoder.inputs_from_call((tokens, lengths), {})
    with torch.no_grad():
        # The graph forward reads scale = 1.0; its first replay is checked.
        with pytest.warns(UserWarning, match="fixed at capture"):
            replayed = manager.execute(inputs)
        eager = manager.encoder.eager_forward("local", inputs)
    assert relative_error(replayed, eager) == 0  # the eager rows serve


# ------------------------------------------------------------------ CUDA


class HostSyncEncoder(ToyEncoder):
    """A graph forward that calls ``.item()``: fine eagerly, fatal to a capture."""

    def graph_forward(self, path, buffers):
        buffers["cu_seqlens"][-1].item()
        return super().graph_forward(path, buffers)


class MaskingEncoder(ToyEncoder):
    """A graph forward that indexes with a boolean mask: a data-dependent shape."""

    def graph_forward(self, path, buffers):
        tokens = buffers["tokens"]
        kept = tokens[tokens[:, 0] == tokens[:, 0]]
        return self.tower.body(kept, buffers["cu_seqlens"])


class HostTensorEncoder(ToyEncoder):
    """A graph forward that copies a host tensor to the device."""

    def graph_forward(self, path, buffers):
        offset = torch.zeros(1, buffers["tokens"].shape[1]).to(buffers["tokens"].device)
        return self.tower.body(buffers["tokens"] + offset, buffers["cu_seqlens"])


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("encoder_class", "words"),
    [(HostSyncEncoder, ".item()"), (MaskingEncoder, ""), (HostTensorEncoder, "")],
    ids=["item", "boolean-mask", "host-tensor"],
)
def test_cuda_an_uncapturable_tower_runs_eagerly(encoder_class, words):
    torch.manual_seed(0)
    tower = ToyTower(global_tokens=4).cuda().eval()
    manager = EncoderGraphManager(
        encoder_class(tower, max_budget=64), budgets=BUDGETS, capture="first_use"
    )
    stream = torch.cuda.current_stream()
    rng = random.Random(0)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for lengths in ([5, 7], [3, 3, 3], [9], [30, 2]):
            tokens, lengths = make_batch(rng, lengths, device="cuda")
            actual = run(manager, tokens, lengths)
            assert relative_error(actual, tower(tokens, lengths)) < 1e-5
    found = messages(caught, "runs eagerly")
    assert len(found) == 2, [str(w.message) for w in caught]
    assert all(words in warning and "Fix:" in warning for warning in found)
    assert not manager.is_captured() and manager.stats.hits == 0
    assert torch.cuda.current_stream() == stream  # the failed capture left no stream behind
    # The device is fine: a capturable tower captures and replays next to it.
    healthy = EncoderGraphManager(
        ToyEncoder(tower, max_budget=64), budgets=BUDGETS, capture="first_use"
    )
    with torch.no_grad():
        tokens, lengths = make_batch(rng, [5, 7], device="cuda")
        assert relative_error(run(healthy, tokens, lengths), tower(tokens, lengths)) < 1e-5
    assert healthy.stats.hits == 2 and healthy.stats.graphs > 0  # local and global


class OutOfMemoryInCaptureEncoder(ToyEncoder):
    """Runs out of memory inside the CUDA graph capture of budget 32."""

    def graph_forward(self, path, buffers):
        if torch.cuda.is_current_stream_capturing() and buffers["tokens"].shape[0] == 32:
            raise out_of_memory()
        return super().graph_forward(path, buffers)


@pytest.mark.cuda
def test_cuda_out_of_memory_inside_a_capture_keeps_the_smaller_budgets():
    torch.manual_seed(0)
    tower = ToyTower().cuda().eval()
    manager = EncoderGraphManager(
        OutOfMemoryInCaptureEncoder(tower), budgets=BUDGETS, capture="first_use"
    )
    stream = torch.cuda.current_stream()
    rng = random.Random(1)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for lengths in ([5, 7], [30], [3] * 7, [9]):
            tokens, lengths = make_batch(rng, lengths, device="cuda")
            assert relative_error(run(manager, tokens, lengths), tower(tokens, lengths)) < 1e-5
    [warning] = messages(caught, "out of memory")
    assert "token budget 32" in warning
    assert list(manager.paths["local"].budgets) == [8, 16]
    assert sorted(key.descriptor.num_tokens for key in manager.cache.keys()) == [8, 16]
    assert all(graph.cuda_graph is not None for graph in manager.cache.graphs())
    assert manager.stats.graphs == 2 and manager.stats.hits > 0
    assert torch.cuda.current_stream() == stream


CUBLAS_ALLOC_FAILED = "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"


def test_a_cublas_allocation_failure_costs_only_the_budgets_that_failed():
    # cuBLAS reports running out of memory in its own words: not an unknown error that
    # turns every path eager.
    tower = ToyTower().eval()
    encoder = FailingEncoder(
        tower, lambda spec: spec.token_budget == 32, lambda: RuntimeError(CUBLAS_ALLOC_FAILED)
    )
    manager = EncoderGraphManager(encoder, budgets=BUDGETS, capture="first_use")
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_and_compare(manager, tower, [[5, 7], [30], [9]])
    [warning] = messages(caught, "out of memory")
    assert "token budget 32" in warning and "keeps budgets [8, 16]" in warning
    assert not messages(caught, "eagerly from now on")
    assert manager.stats.hits == 2 and manager.stats.misses == 1  # 30 tokens: above 16


class CublasFailureInCaptureEncoder(ToyEncoder):
    """cuBLAS fails to allocate inside the CUDA graph capture of budget 32."""

    def graph_forward(self, path, buffers):
        if torch.cuda.is_current_stream_capturing() and buffers["tokens"].shape[0] == 32:
            raise RuntimeError(CUBLAS_ALLOC_FAILED)
        return super().graph_forward(path, buffers)


@pytest.mark.cuda
def test_cuda_a_cublas_allocation_failure_inside_a_capture_keeps_the_smaller_budgets():
    torch.manual_seed(0)
    tower = ToyTower().cuda().eval()
    manager = EncoderGraphManager(
        CublasFailureInCaptureEncoder(tower), budgets=BUDGETS, capture="first_use"
    )
    rng = random.Random(1)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for lengths in ([5, 7], [30], [3] * 7, [9]):
            tokens, lengths = make_batch(rng, lengths, device="cuda")
            assert relative_error(run(manager, tokens, lengths), tower(tokens, lengths)) < 1e-5
    [warning] = messages(caught, "out of memory")
    assert "token budget 32" in warning and "keeps budgets [8, 16]" in warning
    assert not messages(caught, "runs eagerly")
    assert manager.stats.graphs == 2 and manager.stats.hits > 0


def test_a_path_a_fault_turned_eager_counts_plain_misses_and_teaches_no_capture_cost():
    tower = ToyTower().eval()
    encoder = FailingEncoder(tower, lambda spec: True, lambda: RuntimeError(HOST_SYNC))
    manager = EncoderGraphManager(encoder, budgets=BUDGETS, capture="first_use")
    captures = []
    record_capture = manager.policy.record_capture
    manager.policy.record_capture = lambda *args, **kwargs: captures.append(args)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="runs eagerly"):
        run_and_compare(manager, tower, [[5, 7], [3, 3]])
    manager.policy.record_capture = record_capture
    # 12 and 6 tokens fit the budgets: eager because the path is, not above the budgets.
    stats = manager.stats
    assert (stats.misses, stats.eager_above_budget, stats.hits) == (2, 0, 0)
    assert captures == []
