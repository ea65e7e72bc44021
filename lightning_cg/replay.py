"""Replay: fill a graph's static buffers, pad them, replay, and check against eager.

Every replay rewrites every input buffer (the real rows, then the key's
padding rule), so nothing of an earlier batch leaks into a later one, and
clones the real rows of the output, so nothing returned aliases a graph buffer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from lightning_cg.cache import CapturedGraph
from lightning_cg.encoder import GraphableEncoder

#: Largest relative error ||replay - eager|| / ||eager|| that ``verify`` accepts.
VERIFY_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}
#: fp32 tolerance while TF32 is on: cuBLAS/cuDNN pick other TF32 kernels for the
#: padded batch, which differ from eager by about 1e-3.
TF32_TOLERANCE = 5e-3


def replay(
    graph: CapturedGraph,
    encoder: GraphableEncoder,
    padding_rules: Mapping[str, str],
    path: str,
    inputs: Any,
    total: int,
) -> torch.Tensor:
    """Copy ``inputs`` into the graph's buffers, replay, and clone the ``total`` real rows."""
    real = encoder.replay_inputs(path, inputs)
    if not graph.buffers.keys() <= real.keys():
        missing = sorted(graph.buffers.keys() - real.keys())
        raise RuntimeError(f"replay_inputs for path {path!r} lacks buffer(s) {missing}")
    for name, buffer in graph.buffers.items():
        fill(name, buffer, real[name], padding_rules.get(name, "zero"))
    # Clone: the next replay overwrites the graph's output buffer.
    return graph.run()[:total].clone()


def fill(name: str, buffer: torch.Tensor, rows: torch.Tensor, rule: str) -> None:
    """Write ``rows`` into the head of ``buffer`` and pad the rest by ``rule``."""
    count = rows.shape[0]
    if rows.shape[1:] != buffer.shape[1:] or count > buffer.shape[0]:
        raise RuntimeError(
            f"buffer {name!r} holds {tuple(buffer.shape)}; replay rows {tuple(rows.shape)} "
            "do not fit (the adapter's capture_inputs and replay_inputs disagree)"
        )
    # is_cpu/is_cuda: no device objects built on every replay.
    from_host = rows.is_cpu and not buffer.is_cpu
    if rows.dtype != buffer.dtype or (not from_host and rows.device != buffer.device):
        raise RuntimeError(
            f"buffer {name!r} is {buffer.dtype} on {buffer.device}; replay rows are "
            f"{rows.dtype} on {rows.device}; the graph signature should have separated them"
        )
    if from_host:
        # Host metadata: padded where it is, in pinned memory, then one copy
        # that does not wait for the GPU, instead of a copy and a padding kernel.
        buffer.copy_(padded(rows, buffer.shape[0], rule, pin=buffer.is_cuda), non_blocking=True)
        return
    buffer[:count].copy_(rows, non_blocking=True)
    if count == buffer.shape[0]:
        return
    if rule == "repeat_last" and count > 0:
        buffer[count:].copy_(rows[-1:].expand_as(buffer[count:]), non_blocking=True)
    else:
        buffer[count:].zero_()


def padded(rows: torch.Tensor, size: int, rule: str, pin: bool = False) -> torch.Tensor:
    """Host ``rows`` grown to ``size`` rows by the padding rule (``zero`` or
    ``repeat_last``), in a new tensor, in pinned memory if ``pin``."""
    count = rows.shape[0]
    grown = torch.empty((size, *rows.shape[1:]), dtype=rows.dtype, pin_memory=pin)
    grown[:count] = rows
    if rule == "repeat_last" and count > 0:
        grown[count:] = rows[-1]
    else:
        grown[count:] = 0
    return grown


def check_replay(
    graph: CapturedGraph, path: str, replayed: torch.Tensor, reference: torch.Tensor
) -> None:
    """Raise if ``replayed`` differs from the eager ``reference`` beyond tolerance.

    A non-finite value in the eager output is reported as such: the graph
    cannot be judged on it.
    """
    spec = graph.spec
    where = f"path {path!r}, budget {spec.token_budget}, max_items {spec.max_items}"
    if not torch.isfinite(reference).all():
        raise RuntimeError(
            f"verify: the eager output on {where} holds NaN or infinity, so the graph "
            "cannot be compared with it; check the inputs (a NaN or inf in the batch) "
            "or the tower's weights"
        )
    error = relative_error(replayed, reference)
    tolerance = verify_tolerance(reference.dtype)
    if not error <= tolerance:
        raise RuntimeError(
            f"graph replay differs from eager on {where}: relative error {error:.3e} > "
            f"{tolerance:.0e}. The tower reads something at capture time that changes "
            "between calls (a Python scalar, a host tensor, a data-dependent shape)."
        )
    graph.verified = True


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64 (0 for two empty tensors)."""
    actual, expected = actual.double(), expected.double()
    denominator = expected.norm().item()
    difference = (actual - expected).norm().item()
    return difference / denominator if denominator else difference


def verify_tolerance(dtype: torch.dtype) -> float:
    """The relative error ``verify`` accepts for outputs of ``dtype``."""
    tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32
    if dtype == torch.float32 and tf32 and torch.cuda.is_available():
        return TF32_TOLERANCE
    return VERIFY_TOLERANCE.get(dtype, VERIFY_TOLERANCE[torch.float32])


def autocast_key() -> tuple:
    """The autocast state a graph is captured under: ``((device, dtype), ...)``."""
    return tuple(
        (device, torch.get_autocast_dtype(device))
        for device in ("cuda", "cpu")
        if torch.is_autocast_enabled(device)
    )


@contextlib.contextmanager
def graph_context() -> Iterator[None]:
    """Where graphs are captured and replayed.

    Outside inference mode, so static buffers are ordinary tensors that both
    ``Trainer(inference_mode=True)`` and ``False`` may write; without grad; and,
    under autocast, with its weight cache off: a cast cached before capture
    would be freed while the graph still reads it.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.no_grad())
        for device, dtype in autocast_key():
            stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=False))
        yield
