"""GraphableEncoder for any batch-first tower: ``tower(x [B, ...]) -> Tensor [B, ...]``.

Each batch row is one item costing one token on the single path ``image``, so a
token budget is simply a batch size. torchvision's ``vit_b_16`` and ``resnet50``
and timm models fit as they are. A tower called with options or returning more
than one tensor (a ``ModelOutput``, a tuple, a dict) fits
:class:`~lightning_cg.adapters.hf.HFEncoderAdapter`, built on the pieces here.
"""

from __future__ import annotations

import inspect
from collections.abc import Hashable, Mapping, Sequence

import torch
from torch import nn

from lightning_cg.adapters import join_rows, select_rows
from lightning_cg.engine.budget_memory import MIN_ELEMENT_BYTES
from lightning_cg.engine.encoder import CaptureSpec, EncoderGraphConfig, ItemSpec, PathConfig

#: The only encoder path of a batch-first tower.
IMAGE_PATH = "image"
#: Every batch row's spec: one token on the image path (shared: nothing changes a spec).
_ROW_SPEC = ItemSpec(input_size=1, output_tokens=1, path_tokens={IMAGE_PATH: 1})


class BatchedEncoderAdapter:
    """Graph a batch-first tower at batch-size budgets.

    The adapter binds the tower's class ``forward`` at construction, so it keeps
    running the original computation after the callback replaces the instance
    attribute ``tower.forward`` with graph replay. Calling ``forward`` directly
    also means the tower's own module hooks do not run inside the adapter.

    Args:
        tower: a module called as ``tower(x)`` with ``x`` of shape ``[B, ...]``
            that returns one tensor of shape ``[B, ...]``.
        max_batch_size: the largest batch (token budget) worth a graph by default.

    Example:
        >>> from torchvision.models import resnet18
        >>> adapter = BatchedEncoderAdapter(resnet18(num_classes=10).eval(), max_batch_size=8)
        >>> x = adapter.inputs_from_call((torch.randn(2, 3, 64, 64),), {})
        >>> adapter.eager_forward("image", x).shape
        torch.Size([2, 10])
    """

    def __init__(self, tower: nn.Module, max_batch_size: int = 64) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be a positive int, got {max_batch_size}")
        self.tower = tower
        self.max_batch_size = max_batch_size
        self._forward = type(tower).forward.__get__(tower)
        first = next(iter(inspect.signature(self._forward).parameters.values()), None)
        self._input_name = None if first is None else first.name
        #: ``forward(self, *, x)`` takes its batch by name only.
        self._by_keyword = first is not None and first.kind is inspect.Parameter.KEYWORD_ONLY

    def graph_config(self) -> EncoderGraphConfig:
        """One path, ``image``, where every item costs one token.

        ``out_hidden_size`` stays 0: the output shape is only known once the
        tower has run. Compiled with static shapes: a run's batches come in one
        or two sizes, and static kernels are faster.
        """
        return EncoderGraphConfig(
            modalities=("image",),
            paths={IMAGE_PATH: PathConfig(min_token_budget=1)},
            compile_shapes="static",
        )

    def token_budget_range(self, path: str) -> tuple[int, int]:
        """Budgets from a batch of one up to ``max_batch_size``."""
        self._check_path(path)
        return 1, self.max_batch_size

    def min_bytes_per_token(self, path: str) -> int | None:
        """Bytes one token (an image) of a graph's budget needs at least: its row of
        the static input buffer, when the tower fixes its image side (torchvision's
        ViT, a transformers config's ``image_size``); None when the side comes with
        the first batch (see :mod:`lightning_cg.engine.budget_memory`)."""
        self._check_path(path)
        side = fixed_image_side(self.tower)
        channels = getattr(getattr(self.tower, "config", self.tower), "num_channels", 3)
        if side is None or not isinstance(channels, int):
            return None
        return channels * side * side * MIN_ELEMENT_BYTES

    def inputs_from_call(self, args: tuple, kwargs: dict) -> torch.Tensor:
        """The batch tensor of a ``tower(x)`` or ``tower(<name>=x)`` call.

        Raises:
            ValueError: the call is not exactly one tensor, by position or by the
                name of the forward's first parameter.
        """
        if len(args) == 1 and not kwargs:
            x = args[0]
        elif not args and len(kwargs) == 1 and self._input_name in kwargs:
            x = kwargs[self._input_name]
        else:
            raise ValueError(
                self._convention_message(
                    f"got {len(args)} positional arguments and keyword arguments {sorted(kwargs)}"
                )
            )
        if not isinstance(x, torch.Tensor) or x.dim() < 1:
            raise ValueError(
                self._convention_message(f"got {type(x).__name__} instead of a batch tensor")
            )
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
        """Stack the items' rows back into one ``[B, ...]`` tensor.

        An empty batch runs the tower on the empty input, since only the tower
        knows the shape of an output row.
        """
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
    """The square image side a tower requires (torchvision's ViT ``image_size``, a
    transformers config's ``image_size``), or None when it takes any side."""
    side = getattr(getattr(tower, "config", tower), "image_size", None)
    return side if isinstance(side, int) and not isinstance(side, bool) else None


def dummy_rows(
    count: int, item_shape: Sequence[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Valid capture data: ``count`` random rows (zeros for integer and boolean dtypes)."""
    shape = (count, *item_shape)
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype, device=device)
    return torch.zeros(shape, dtype=dtype, device=device)
