"""GraphableEncoder for any batch-first tower: ``tower(x [B, ...]) -> Tensor [B, ...]``.

Each batch row is one item costing one token on the single path ``image``, so a token
budget is a batch size (torchvision and timm models fit as they are).
"""

from __future__ import annotations

import inspect
from collections.abc import Hashable, Mapping, Sequence

import torch
from torch import nn

from lightning_cg.adapters import is_transformers_tower, join_rows, select_rows
from lightning_cg.engine.budget_memory import MIN_ELEMENT_BYTES
from lightning_cg.engine.encoder import CaptureSpec, EncoderGraphConfig, ItemSpec, PathConfig

#: The only encoder path of a batch-first tower.
IMAGE_PATH = "image"
#: Every batch row's spec: one token on the image path.
_ROW_SPEC = ItemSpec(input_size=1, output_tokens=1, path_tokens={IMAGE_PATH: 1})


class BatchedEncoderAdapter:
    """Graph a batch-first tower at batch-size budgets (up to ``max_batch_size`` by default).

    The tower's class ``forward`` is bound at construction, so the adapter keeps running
    the original computation after the callback replaces ``tower.forward`` (the tower's
    module hooks do not run inside the adapter).
    """

    def __init__(self, tower: nn.Module, max_batch_size: int = 64) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be a positive int, got {max_batch_size}")
        self.tower = tower
        self.max_batch_size = max_batch_size
        if type(self) is BatchedEncoderAdapter and is_transformers_tower(tower):
            raise TypeError(self._convention_message("a transformers model returns a ModelOutput"))
        self._forward = type(tower).forward.__get__(tower)
        first = next(iter(inspect.signature(self._forward).parameters.values()), None)
        self._input_name = None if first is None else first.name
        #: ``forward(self, *, x)`` takes its batch by name only.
        self._by_keyword = first is not None and first.kind is inspect.Parameter.KEYWORD_ONLY

    def graph_config(self) -> EncoderGraphConfig:
        """One path, ``image``; the output width is learnt when the tower runs; static shapes."""
        return EncoderGraphConfig(
            paths={IMAGE_PATH: PathConfig(min_token_budget=1)},
            compile_shapes="static",
        )

    def token_budget_range(self, path: str) -> tuple[int, int]:
        """Budgets from a batch of one up to ``max_batch_size``."""
        self._check_path(path)
        return 1, self.max_batch_size

    def min_bytes_per_token(self, path: str) -> int | None:
        """Least bytes per token of the input buffer when the tower fixes its side, else None."""
        self._check_path(path)
        side = fixed_image_side(self.tower)
        channels = getattr(getattr(self.tower, "config", self.tower), "num_channels", 3)
        if side is None or not isinstance(channels, int):
            return None
        return channels * side * side * MIN_ELEMENT_BYTES

    def inputs_from_call(self, args: tuple, kwargs: dict) -> torch.Tensor:
        """The batch tensor of a ``tower(x)`` or ``tower(<name>=x)`` call (else ValueError)."""
        if len(args) == 1 and not kwargs:
            x = args[0]
        elif not args and len(kwargs) == 1 and self._input_name in kwargs:
            x = kwargs[self._input_name]
        else:
            got = f"got {len(args)} positional arguments and keyword arguments {sorted(kwargs)}"
            raise ValueError(self._convention_message(got))
        if not isinstance(x, torch.Tensor) or x.dim() < 1:
            got = f"got {type(x).__name__} instead of a batch tensor"
            raise ValueError(self._convention_message(got))
        return x

    def item_specs(self, inputs: torch.Tensor) -> list[ItemSpec]:
        """One single-token item per batch row."""
        return [_ROW_SPEC] * inputs.shape[0]

    def select_items(self, inputs: torch.Tensor, indices: Sequence[int]) -> torch.Tensor:
        """The rows at ``indices``, in that order (a view when they are consecutive)."""
        return select_rows(inputs, indices)

    def graph_signature(self, inputs: torch.Tensor) -> Hashable:
        """Per-item shape, dtype and device: 224 px and 384 px batches get separate graphs."""
        return tuple(inputs.shape[1:]), inputs.dtype, inputs.device

    def capture_inputs(self, spec: CaptureSpec) -> dict[str, torch.Tensor]:
        """A batch of ``spec.token_budget`` random rows of the signature's shape."""
        self._check_path(spec.path)
        item_shape, dtype, device = spec.signature
        return {"x": dummy_rows(spec.token_budget, item_shape, dtype, device)}

    def replay_inputs(self, path: str, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """The batch itself; the manager zero-pads it up to the budget."""
        self._check_path(path)
        return {"x": inputs}

    def graph_forward(self, path: str, buffers: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The original forward on the padded static batch; one output row per row."""
        self._check_path(path)
        return self._run(buffers["x"])

    def eager_forward(self, path: str, inputs: torch.Tensor) -> torch.Tensor:
        """The original forward on exactly ``inputs``."""
        self._check_path(path)
        return self._run(inputs)

    def postprocess(
        self, outputs: list[dict[str, torch.Tensor]], inputs: torch.Tensor
    ) -> torch.Tensor:
        """The items' rows as one ``[B, ...]`` tensor (an empty batch runs the tower on it)."""
        if not outputs:
            return self._run(inputs)
        return join_rows([output[IMAGE_PATH] for output in outputs])

    def postprocess_joined(
        self, path_rows: Mapping[str, torch.Tensor], inputs: torch.Tensor
    ) -> torch.Tensor:
        """The ``[B, ...]`` output from the rows of every item in order: those rows."""
        return path_rows[IMAGE_PATH]

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        out = self._forward(**{self._input_name: x}) if self._by_keyword else self._forward(x)
        if not isinstance(out, torch.Tensor):
            raise TypeError(self._convention_message(f"the tower returned {type(out).__name__}"))
        return out

    def _convention_message(self, got: str) -> str:
        return (
            f"BatchedEncoderAdapter serves towers called as tower(x) with one batch-first "
            f"tensor x [B, ...] that return one tensor [B, ...]; {got}. For "
            f"{type(self.tower).__name__}, use adapter='hf' if it takes keyword options or "
            "returns a ModelOutput, a tuple or a dict of batch-first tensors (transformers "
            "towers), or implement lightning_cg.engine.encoder.GraphableEncoder for other calling "
            "conventions."
        )

    def _check_path(self, path: str) -> None:
        if path != IMAGE_PATH:
            raise ValueError(
                f"unknown encoder path {path!r}; BatchedEncoderAdapter has only 'image'"
            )


def fixed_image_side(tower: nn.Module) -> int | None:
    """The square image side a tower requires (its or its config's ``image_size``), or None."""
    side = getattr(getattr(tower, "config", tower), "image_size", None)
    return side if isinstance(side, int) and not isinstance(side, bool) else None


def dummy_rows(
    count: int, item_shape: Sequence[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Valid capture data: ``count`` random rows (zeros for integer and boolean dtypes),
    drawn from a generator of their own: the user's random stream is left as it was."""
    shape = (count, *item_shape)
    if not dtype.is_floating_point:
        return torch.zeros(shape, dtype=dtype, device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    return torch.randn(shape, dtype=dtype, device=device, generator=generator)
