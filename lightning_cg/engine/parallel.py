"""Data-parallel encoding: ranks that all hold the same batch share its items.

Each rank encodes the share :func:`assign_items` gives it (a pure function of the specs,
so no rank needs to ask). A header all_gather agrees on the rows' dtype and shape and
carries a spec fingerprint and a failure flag, so a failed or mismatched rank makes every
rank raise instead of hanging. Collectives never run inside a captured graph.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_cg.engine.encoder import ItemSpec
from lightning_cg.engine.manager import EncoderGraphManager

#: Most trailing dimensions of an output row the header can describe.
MAX_TRAILING_DIMS = 6
#: int64 entries of a rank's header: status, spec fingerprint, dtype, ndim, dims.
HEADER_SIZE = 4 + MAX_TRAILING_DIMS
#: Output dtypes the header can name, by index.
GATHER_DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)

# Header status of a rank.
_NO_ROWS, _ROWS, _FAILED = 0, 1, 2


def assign_items(input_sizes: Sequence[int], world_size: int) -> list[list[int]]:
    """Item indices per rank (ascending): largest input first, each to the least-loaded
    rank; ties go to the lower rank and index.

    Example:
        >>> assign_items([4, 1, 3, 2], world_size=2)
        [[0, 1], [2, 3]]
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer; got {world_size!r}")
    for index, size in enumerate(input_sizes):
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"input_sizes[{index}] must be a non-negative integer; got {size!r}")
    loads = [0] * world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for index in sorted(range(len(input_sizes)), key=lambda i: (-input_sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shares[rank].append(index)
        loads[rank] += input_sizes[index]
    return [sorted(share) for share in shares]


def execute_data_parallel(
    manager: EncoderGraphManager,
    inputs: Any,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> Any:
    """Encode a batch that every rank of ``group`` holds, each rank a share of its items.

    Every rank must call this with the same batch (its item sizes are checked, not its
    values), even one without items, and gets the postprocessed output of all; ``device``
    runs the collectives (None: the current CUDA device under NCCL, else the CPU). With
    grad enabled each rank runs the whole batch."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("execute_data_parallel needs an initialised torch.distributed group")
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if world_size == 1 or torch.is_grad_enabled():
        return manager.execute(inputs)
    encoder = manager.encoder
    if device is None:
        nccl = dist.get_backend(group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    specs = encoder.item_specs(inputs)
    paths = list(manager.paths)
    shares = assign_items([spec.input_size for spec in specs], world_size)
    error: Exception | None = None
    rows = None
    try:
        rows = _local_rows(manager, inputs, shares[rank], specs, paths, device)
    except Exception as exception:  # reported to every rank through the header
        error = exception
    headers = [
        header.tolist() for header in _all_gather(_header(specs, rows, error, device), group)
    ]
    trailing, dtype = _agree(headers, error)
    outputs: list[dict[str, torch.Tensor]] = [{} for _ in specs]
    if dtype is not None:
        counts = [
            sum(specs[i].path_tokens.get(path, 0) for i in share for path in paths)
            for share in shares
        ]
        # Ranks send equal shapes: each pads its rows to the longest share.
        padded = torch.zeros((max(counts), *trailing), dtype=dtype, device=device)
        if rows is not None:
            padded[: rows.shape[0]] = rows
        gathered = _all_gather(padded, group)
        for share, count, rank_rows in zip(shares, counts, gathered, strict=True):
            _scatter(rank_rows[:count], share, specs, paths, outputs)
    return encoder.postprocess(outputs, inputs)


def _local_rows(
    manager: EncoderGraphManager,
    inputs: Any,
    share: list[int],
    specs: list[ItemSpec],
    paths: list[str],
    device: torch.device,
) -> torch.Tensor | None:
    """This rank's rows, item by item and path by path; None when it has none."""
    if not share:
        return None
    outputs = manager.execute_items(manager.encoder.select_items(inputs, share))
    parts = []
    for index, item in zip(share, outputs, strict=True):
        for path in paths:
            tokens = specs[index].path_tokens.get(path, 0)
            rows = item.get(path)
            if tokens and (rows is None or rows.shape[0] != tokens):
                got = "none" if rows is None else rows.shape[0]
                raise RuntimeError(
                    f"item {index} has {got} output rows on path {path!r}; "
                    f"its ItemSpec promises {tokens}"
                )
            if tokens:
                parts.append(rows)
    if not parts:
        return None
    first = parts[0]
    for rows in parts[1:]:
        if rows.shape[1:] != first.shape[1:] or rows.dtype != first.dtype:
            raise RuntimeError(
                "every path's rows must share one dtype and trailing shape to be gathered; got "
                f"{first.dtype} {tuple(first.shape[1:])} and {rows.dtype} {tuple(rows.shape[1:])}"
            )
    if first.dim() - 1 > MAX_TRAILING_DIMS or first.dtype not in GATHER_DTYPES:
        raise RuntimeError(
            f"rows of {first.dtype} with trailing shape {tuple(first.shape[1:])} cannot be "
            f"gathered; allowed: at most {MAX_TRAILING_DIMS} trailing dims of "
            f"{', '.join(str(dtype) for dtype in GATHER_DTYPES)}"
        )
    return torch.cat(parts).to(device)


def _header(
    specs: list[ItemSpec], rows: torch.Tensor | None, error: Exception | None, device: torch.device
) -> torch.Tensor:
    header = torch.full((HEADER_SIZE,), -1, dtype=torch.int64)
    fingerprint = [(s.input_size, sorted(s.path_tokens.items()), s.num_frames) for s in specs]
    header[1] = zlib.crc32(repr(fingerprint).encode())
    if error is not None:
        header[0] = _FAILED
    elif rows is None:
        header[0] = _NO_ROWS
    else:
        trailing = rows.shape[1:]
        header[0] = _ROWS
        header[2] = GATHER_DTYPES.index(rows.dtype)
        header[3] = len(trailing)
        header[4 : 4 + len(trailing)] = torch.tensor(trailing, dtype=torch.int64)
    return header.to(device)


def _all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, tensor, group=group)
    return gathered


def _agree(
    headers: list[list[int]], error: Exception | None
) -> tuple[tuple[int, ...], torch.dtype | None]:
    """The rows' trailing shape and dtype (None: no rank has rows); raises on every rank alike."""
    if error is not None:
        raise error
    failed = [r for r, header in enumerate(headers) if header[0] == _FAILED]
    if failed:
        raise RuntimeError(
            f"rank(s) {failed} failed to encode their share of the batch; see their error"
        )
    if len({header[1] for header in headers}) > 1:
        raise RuntimeError(
            "execute_data_parallel needs every rank to receive the same batch, but the item "
            "specs differ across ranks. Under Lightning DDP pass "
            "Trainer(use_distributed_sampler=False), or turn encoder_data_parallel off."
        )
    layouts = {
        (header[2], tuple(header[4 : 4 + header[3]])) for header in headers if header[0] == _ROWS
    }
    if not layouts:
        return (), None
    if len(layouts) > 1:
        described = sorted((str(GATHER_DTYPES[d]), shape) for d, shape in layouts)
        raise RuntimeError(f"ranks' output rows differ in dtype or trailing shape: {described}")
    [(dtype_index, trailing)] = layouts
    return trailing, GATHER_DTYPES[dtype_index]


def _scatter(
    rows: torch.Tensor,
    share: list[int],
    specs: list[ItemSpec],
    paths: list[str],
    outputs: list[dict[str, torch.Tensor]],
) -> None:
    """Split one rank's unpadded rows back into ``outputs[item][path]``."""
    keys = [(index, path) for index in share for path in paths]
    tokens = [specs[index].path_tokens.get(path, 0) for index, path in keys]
    for (index, path), count, part in zip(keys, tokens, rows.split(tokens), strict=True):
        if count:
            outputs[index][path] = part
