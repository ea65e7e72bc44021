"""A graph's static input buffers, and how each replay rewrites them whole.

Every replay writes the real rows, then the padding rule's rows past them. Host rows
are written with numpy where the dtype allows: into a CPU buffer itself, else into the
graph's reused pinned staging (:class:`HostStaging`), copied over without waiting.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, KeysView, Mapping, Sequence
from types import MappingProxyType

import numpy as np
import torch

#: Most sets of pinned staging tensors one graph keeps (see :class:`HostStaging`).
MAX_STAGING_SLOTS = 4
#: Dtypes whose host rows are written with numpy (:func:`write_padded_array`).
_NUMPY_DTYPES = frozenset(
    {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
    | {torch.float16, torch.float32, torch.float64}
)
_Pieces = Sequence[np.ndarray]  # host rows in pieces
_NO_PIECES: Mapping[str, _Pieces] = MappingProxyType({})
#: ``(stream id, device index, device type)`` of a device's current stream (private torch).
_current_stream_id = getattr(torch._C, "_cuda_getCurrentStream", None)


class PieceRows(Mapping[str, torch.Tensor]):
    """Replay rows by buffer name, some given as numpy pieces to stack (e.g. patch
    positions frame by frame).

    :meth:`StaticInputs.fill` writes the pieces one by one, never stacking them; any
    other reader gets one host tensor, stacked at its first read.
    """

    def __init__(
        self, tensors: Mapping[str, torch.Tensor], pieces: Mapping[str, Sequence[np.ndarray]]
    ) -> None:
        both = tensors.keys() & pieces.keys()
        if both:
            raise ValueError(f"rows given both whole and in pieces: {sorted(both)}")
        self.pieces = pieces
        self._tensors = dict(tensors)
        # A dict's keys: a set view that StaticInputs.fill compares at C speed.
        self._names = dict.fromkeys([*tensors, *pieces]).keys()

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._tensors.get(name)
        if tensor is None:
            tensor = self._tensors[name] = torch.from_numpy(np.concatenate(self.pieces[name]))
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def keys(self) -> KeysView[str]:
        return self._names


class StaticInputs:
    """The input buffers of one graph, rewritten by :meth:`fill` before each replay;
    padding rules are fixed at capture (``zero`` for a buffer without one)."""

    def __init__(
        self, buffers: Mapping[str, torch.Tensor], padding_rules: Mapping[str, str]
    ) -> None:
        self._buffers = [
            _Buffer(name, tensor, padding_rules.get(name, "zero"))
            for name, tensor in buffers.items()
        ]
        self._names = frozenset(buffers)
        # Made at the first replay that brings host rows for a CUDA buffer.
        self._staging: HostStaging | None = None

    def fill(self, real: Mapping[str, torch.Tensor], path: str) -> None:
        """Write each buffer's rows of ``real`` at its head and pad the rest by its rule;
        RuntimeError if a buffer is missing or its rows do not fit it."""
        if not self._names <= real.keys():
            missing = sorted(self._names - real.keys())
            raise RuntimeError(f"replay_inputs for path {path!r} lacks buffer(s) {missing}")
        pieces = real.pieces if isinstance(real, PieceRows) else _NO_PIECES
        staged = []
        for buffer in self._buffers:
            rows = pieces.get(buffer.name)
            if rows is not None:
                from_host = buffer.is_cuda
            else:
                rows = real[buffer.name]
                from_host = buffer.takes_from_host(rows)
            if from_host:
                staged.append((buffer, rows))
            else:
                buffer.write(buffer.tensor, buffer.array, rows)
        if staged:
            if self._staging is None:
                self._staging = HostStaging()
            self._staging.copy(staged)


def write_padded(target: torch.Tensor, rows: torch.Tensor, rule: str) -> None:
    """Write ``rows`` at the head of ``target``, the rest zeros or (repeat_last) the last row."""
    count = rows.shape[0]
    if count == target.shape[0]:
        target.copy_(rows)  # no slicing: a few microseconds of host time less
        return
    target[:count].copy_(rows)
    padding = target[count:]
    if rule == "repeat_last" and count:
        padding.copy_(rows[-1:].expand_as(padding))
    else:
        padding.zero_()


def write_padded_array(target: np.ndarray, rows: np.ndarray, rule: str) -> None:
    """:func:`write_padded` for numpy arrays (far less host time than a torch op)."""
    count = rows.shape[0]
    target[:count] = rows
    _pad_array(target, count, rule)


def _pad_array(target: np.ndarray, count: int, rule: str) -> None:
    """Fill ``target`` past its first ``count`` rows by the padding ``rule``."""
    if count < target.shape[0]:
        target[count:] = target[count - 1] if rule == "repeat_last" and count else 0


class _Buffer:
    """One static buffer, and what every replay checks its rows against."""

    __slots__ = (
        "array",
        "device",
        "device_index",
        "dtype",
        "is_cpu",
        "is_cuda",
        "name",
        "numpy_dtype",
        "row_capacity",
        "rule",
        "row_shape",
        "tensor",
    )

    def __init__(self, name: str, tensor: torch.Tensor, rule: str) -> None:
        self.name = name
        self.tensor = tensor
        self.rule = rule
        self.row_capacity = tensor.shape[0]
        self.row_shape = tensor.shape[1:]
        self.dtype = tensor.dtype
        self.device = tensor.device
        self.is_cpu = tensor.is_cpu
        self.is_cuda = tensor.is_cuda
        self.device_index = tensor.get_device()  # -1 on the CPU
        # The dtype of host pieces (None where numpy lacks the buffer's dtype).
        self.numpy_dtype = (
            torch.empty(0, dtype=self.dtype).numpy().dtype if self.dtype in _NUMPY_DTYPES else None
        )
        # A CPU buffer's own memory, which host rows are written into with numpy (which
        # shares it only for a numpy dtype without autograd).
        numpy_safe = self.numpy_dtype is not None and not tensor.requires_grad
        self.array = tensor.numpy() if self.is_cpu and numpy_safe else None

    def takes_from_host(self, rows: torch.Tensor) -> bool:
        """Whether ``rows`` go through pinned staging (host rows for a CUDA buffer);
        RuntimeError if they do not fit the buffer."""
        shape = rows.shape  # read once: each read of a tensor's shape builds a new Size
        if shape[1:] != self.row_shape or shape[0] > self.row_capacity:
            raise RuntimeError(
                f"buffer {self.name!r} holds {tuple(self.tensor.shape)}; replay rows "
                f"{tuple(rows.shape)} do not fit (the adapter's capture_inputs and "
                "replay_inputs disagree)"
            )
        # is_cpu: no device object built for host rows.
        from_host = rows.is_cpu and not self.is_cpu
        if rows.dtype != self.dtype or (not from_host and rows.device != self.device):
            raise RuntimeError(
                f"buffer {self.name!r} is {self.dtype} on {self.device}; replay rows are "
                f"{rows.dtype} on {rows.device}; the graph signature should have separated them"
            )
        return from_host and self.is_cuda

    def write(
        self, tensor: torch.Tensor, array: np.ndarray | None, rows: torch.Tensor | _Pieces
    ) -> None:
        """Write host ``rows`` or pieces at the head of ``tensor`` (the buffer or its
        staging; ``array`` its numpy view or None), then pad by the buffer's rule."""
        if not isinstance(rows, torch.Tensor):
            self._write_pieces(array, rows)
        elif array is not None and not rows.requires_grad:
            # takes_from_host checked that rows have the buffer's (numpy) dtype.
            write_padded_array(array, rows.numpy(), self.rule)
        else:
            write_padded(tensor, rows, self.rule)

    def _write_pieces(self, target: np.ndarray | None, pieces: _Pieces) -> None:
        """Write ``pieces`` in turn at the head of ``target``; RuntimeError if one does not fit."""
        count = 0
        for piece in pieces:
            end = count + piece.shape[0]
            if (
                piece.dtype != self.numpy_dtype
                or piece.shape[1:] != self.row_shape
                or end > self.row_capacity
            ):
                raise RuntimeError(
                    f"buffer {self.name!r} holds {tuple(self.tensor.shape)} of {self.dtype}; "
                    f"replay rows in pieces of {piece.dtype} rows {piece.shape[1:]} reach row "
                    f"{end} (the adapter's capture_inputs and replay_inputs disagree)"
                )
            target[count:end] = piece
            count = end
        _pad_array(target, count, self.rule)


class HostStaging:
    """Pinned host copies of a graph's CUDA buffers that take host rows, reused.

    A pinned copy returns before the GPU reads it, so a staging tensor may be rewritten
    only after its copy ran. Staging comes in slots with an event after their copies: a
    replay takes the oldest slot once done, else adds one (up to
    :data:`MAX_STAGING_SLOTS`), else waits. One slot would make every replay wait for
    the previous graph; a few let the host run a few replays ahead.
    """

    def __init__(self) -> None:
        self._slots: deque[_Slot] = deque()
        # The current stream last recorded on: what identifies it, and the object.
        self._stream_id: tuple[int, int, int] | None = None
        self._stream: torch.cuda.Stream | None = None

    def copy(self, staged: list[tuple[_Buffer, torch.Tensor | _Pieces]]) -> None:
        """Pad each ``(buffer, host rows or pieces)`` in a free slot, then copy it into
        its buffer without waiting for the GPU."""
        slot = self._free_slot()
        for buffer, rows in staged:
            pinned, array = slot.host(buffer)
            buffer.write(pinned, array, rows)
            buffer.tensor.copy_(pinned, non_blocking=True)
        # The stream the copies went to: the current one of the buffers' device.
        slot.event.record(self._current_stream(staged[0][0].device_index))
        self._slots.append(slot)

    def _current_stream(self, device_index: int) -> torch.cuda.Stream:
        """``torch.cuda.current_stream(device_index)`` for a fraction of its host time:
        the stream object is made again only when the stream changes."""
        if _current_stream_id is None:
            return torch.cuda.current_stream(device_index)
        stream_id = _current_stream_id(device_index)
        if stream_id != self._stream_id:
            self._stream_id = stream_id
            self._stream = torch.cuda.Stream(
                stream_id=stream_id[0], device_index=stream_id[1], device_type=stream_id[2]
            )
        return self._stream

    def _free_slot(self) -> _Slot:
        if self._slots and self._slots[0].event.query():
            return self._slots.popleft()
        if len(self._slots) < MAX_STAGING_SLOTS:
            return _Slot()
        oldest = self._slots.popleft()
        oldest.event.synchronize()
        return oldest


class _Slot:
    """One pinned tensor per staged buffer (made when first needed), and the event after
    their last copies."""

    __slots__ = ("event", "hosts")

    def __init__(self) -> None:
        self.event = torch.cuda.Event()
        self.hosts: dict[str, tuple[torch.Tensor, np.ndarray | None]] = {}

    def host(self, buffer: _Buffer) -> tuple[torch.Tensor, np.ndarray | None]:
        """The pinned tensor of ``buffer`` and its numpy view (None for dtypes numpy lacks)."""
        host = self.hosts.get(buffer.name)
        if host is None:
            pinned = torch.empty(buffer.tensor.shape, dtype=buffer.dtype, pin_memory=True)
            array = pinned.numpy() if buffer.numpy_dtype is not None else None
            host = self.hosts[buffer.name] = (pinned, array)
        return host
