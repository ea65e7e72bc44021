"""What went wrong in a capture: out of memory, or a tower a CUDA graph cannot hold.

CUDA reports most faults twice (the op, then ending the capture "due to a previous
error"), so :func:`diagnose` reads the whole exception chain. Code that ran eagerly just
before and fails inside the capture (:func:`capturing`) is a capture fault.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from dataclasses import dataclass

import torch

#: Kinds of capture fault; CAPTURE_FAILED (an unknown cause) turns every path eager.
OUT_OF_MEMORY = "out_of_memory"
UNCAPTURABLE = "uncapturable"
CAPTURE_FAILED = "capture_failed"


class CaptureError(RuntimeError):
    """Raised inside a CUDA graph capture by a forward that had just run eagerly."""


class ChangesState(RuntimeError):
    """Raised after a capture whose warm-up forwards changed the tower's buffers."""

    def __init__(self, buffers: list[str]) -> None:
        names = ", ".join(buffers[:5]) + (", ..." if len(buffers) > 5 else "")
        super().__init__(f"the forward changed the buffers {names}")


@dataclass(frozen=True)
class CaptureFault:
    """A capture failure the manager can recover from; ``error`` is the first line of
    the error that said so."""

    kind: str
    cause: str
    fix: str
    error: str

    def __str__(self) -> str:
        return f"{self.cause} ({self.error}): {self.fix}"


#: (lower-case markers in an error message, cause, fix), most specific first.
_UNCAPTURABLE: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (
        (
            "operation not permitted when stream is capturing",
            "cudaerrorstreamcaptureunsupported",
            "cannot be called during cuda graph capture",
        ),
        "the tower calls .item() / .tolist() / .cpu() / a boolean mask or nonzero "
        "(a host sync) during capture",
        "move it out of the graphed forward into replay metadata: compute it in "
        "replay_inputs and pass it as a static buffer, or keep the value on the device",
    ),
    (
        (
            "cannot copy between cpu and cuda tensors during cuda graph capture",
            "legacy stream depend on a capturing blocking stream",
            "cudaerrorstreamcaptureimplicit",
            "dependency created on uncaptured work",
            "cudaerrorstreamcaptureisolation",
        ),
        "the tower runs a CPU op or copies a host tensor to the device during capture",
        "build host-side tensors outside the graphed forward (in capture_inputs and "
        "replay_inputs) and pass them as static buffers, or register constants as "
        "module buffers on the tower's device",
    ),
    (
        (
            "data-dependent",
            "data dependent",
            "dynamic shape operator",
            "datadependentoutputexception",
        ),
        "the tower's shapes depend on the data (nonzero, masked_select, unique, a boolean mask)",
        "give the graphed forward fixed shapes: mask with torch.where instead of indexing, "
        "and compute data-dependent sizes in replay_inputs",
    ),
    (
        (
            "stream is capturing",
            "capturing stream",
            "during capture",
            "cudaerrorstreamcapture",
            "capture must end",
            "invalid capture",
        ),
        "the tower does something a CUDA graph cannot hold during capture (most often a "
        "host sync such as .item())",
        "keep the graphed forward to device ops on the static buffers; build metadata in "
        "replay_inputs",
    ),
)


def diagnose(error: BaseException) -> CaptureFault | None:
    """The fault behind ``error`` raised while capturing, or None if it is not one.

    Example:
        >>> error = RuntimeError("CUDA error: operation not permitted when stream is capturing")
        >>> diagnose(error).kind
        'uncapturable'
    """
    chain = _chain(error)
    for link in chain:
        if is_out_of_memory(link):
            return CaptureFault(
                OUT_OF_MEMORY,
                "out of device memory",
                "lower the path's max_budget or max_items_per_batch",
                _first_line(link),
            )
    if isinstance(error, ChangesState):
        return CaptureFault(
            UNCAPTURABLE,
            "the tower's forward changes its buffers (a step counter, a running statistic)",
            "keep evaluation forwards free of state changes, or run this tower without "
            "graphs; the buffers were put back as they were before the capture",
            str(error),
        )
    messages = [(link, str(link).lower()) for link in chain if isinstance(link, Exception)]
    for markers, cause, fix in _UNCAPTURABLE:
        for link, message in messages:
            if any(marker in message for marker in markers):
                return CaptureFault(UNCAPTURABLE, cause, fix, _first_line(link))
    if isinstance(error, CaptureError):
        _, cause, fix = _UNCAPTURABLE[-1]
        return CaptureFault(UNCAPTURABLE, cause, fix, _first_line(chain[-1]))
    return None


def capture_failed(error: BaseException) -> CaptureFault:
    """A :data:`CAPTURE_FAILED` fault for an error :func:`diagnose` does not know."""
    return CaptureFault(
        CAPTURE_FAILED,
        "capturing raised an error of unknown cause",
        "run the tower eagerly on a batch like this one; if that works, report the error",
        _first_line(error),
    )


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation failure on the device."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    message = str(error).lower()
    return isinstance(error, RuntimeError) and any(
        marker in message for marker in ("out of memory", "status_alloc_failed")
    )


def free_device_memory() -> None:
    """Collect what dropped graphs leave behind and return cached device memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def capturing() -> Iterator[None]:
    """Around ``torch.cuda.graph`` after an eager warm-up of the same forward.

    An ``Exception`` other than out of memory becomes a :class:`CaptureError`: the
    forward ran eagerly, so the capture broke it. The current stream is put back, which
    ``torch.cuda.graph`` leaves as its capture stream when ending a failed capture raises.
    """
    stream = torch.cuda.current_stream() if torch.cuda.is_available() else None
    try:
        yield
    except BaseException as error:
        if stream is not None:
            torch.cuda.set_stream(stream)
            # The failed capture skipped the RNG's epilogue, which would fail every later CUDA
            # random op; re-setting the generator's own state takes it out of capture mode.
            generator = torch.cuda.default_generators[torch.cuda.current_device()]
            generator.graphsafe_set_state(generator.clone_state())
        if isinstance(error, Exception) and not is_out_of_memory(error):
            raise CaptureError(
                f"{type(error).__name__} while capturing a graph: {error}"
            ) from error
        raise


def _chain(error: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    link: BaseException | None = error
    while link is not None and all(link is not seen for seen in chain):
        chain.append(link)
        link = link.__cause__ or link.__context__
    return chain


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")
