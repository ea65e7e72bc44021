"""Compiled capture: the manager captures a torch.compile'd graph forward.

Inductor's fused kernels make a graph replay fewer kernels. The default compile mode:
the manager does the graphing, so inductor's own cudagraphs stay off. A failed compile
turns every path eager; a compiled graph whose first replay differs from eager gives
compiling up.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from lightning_cg.core.dispatcher import GraphMode
from lightning_cg.engine.compile_regions import (
    CompiledBlocks,
    blocks_to_compile,
    specialized_floats,
)
from lightning_cg.engine.encoder import CaptureSpec, EncoderGraphConfig, GraphableEncoder, ItemSpec

if TYPE_CHECKING:  # config imports this module for check_compile
    from lightning_cg.engine.config import GraphConfig


def check_compile(compile: bool, mode: GraphMode) -> bool:
    """``compile`` if it is a bool and, when it is True, ``mode`` captures graphs."""
    if not isinstance(compile, bool):
        raise ValueError(f"compile must be true or false; got compile={compile!r}")
    if compile and mode is GraphMode.NONE:
        raise ValueError(
            "compile=True compiles the graphs' forward; mode 'none' captures no graph. "
            "Use compile=False, or a mode with graphs: full, full_uniform_only"
        )
    return compile


def compiled_encoder_for(encoder: GraphableEncoder, config: GraphConfig) -> CompiledEncoder | None:
    """The compiling wrapper around ``encoder`` for ``config.compile`` True, else None."""
    return CompiledEncoder(encoder) if config.compile else None


class CompiledEncoder:
    """A :class:`~lightning_cg.engine.encoder.GraphableEncoder` whose graph forward is compiled.

    Every other method is the wrapped encoder's. Compiling happens at each path's first
    graph forward (with static shapes, also at a new buffer shape's).

    Args:
        backend: the ``torch.compile`` backend (``eager`` / ``aot_eager`` only trace, for tests).
        on_compile: called with the seconds of each graph forward that may compile.

    Example:
        >>> manager = EncoderGraphManager(CompiledEncoder(PackedEncoderAdapter(tower)))
        >>> # or: EncoderGraphManager(PackedEncoderAdapter(tower), compile=True)
    """

    def __init__(
        self,
        encoder: GraphableEncoder,
        backend: str | Callable = "inductor",
        on_compile: Callable[[float], None] | None = None,
    ) -> None:
        if not isinstance(encoder, GraphableEncoder):
            raise TypeError(
                "encoder must implement lightning_cg.engine.encoder.GraphableEncoder; "
                f"got {type(encoder)!r}"
            )
        self.encoder = encoder
        #: Whether a path's new buffer shapes compile (``compile_shapes="static"``).
        self.static_shapes = encoder.graph_config().compile_shapes == "static"
        # dynamic None: torch.compile's automatic dynamic shapes, static until a size changes.
        compile_function = functools.partial(
            torch.compile, dynamic=None if self.static_shapes else True, backend=backend
        )
        self._compile_function = compile_function
        blocks = blocks_to_compile(getattr(encoder, "tower", None), not self.static_shapes)
        #: The compiled repeated blocks; None when the whole graph forward is compiled.
        self.compiled_blocks = CompiledBlocks(blocks, compile_function) if blocks else None
        #: Seconds of the graph forwards that may compile: compilation, mostly.
        self.compile_seconds = 0.0
        self.on_compile = on_compile
        #: Whether graph forwards run compiled (until :meth:`give_up`).
        self.started = True
        #: Called once compiling is given up (:meth:`give_up`).
        self.on_give_up: Callable[[], None] | None = None
        #: Why compiling was given up (outputs that differ from eager), or None.
        self.compile_error: str | None = None
        # The adapter's (path, buffers) -> bool: which graphs collect per-layer outputs.
        self._collects_layer_outputs = getattr(encoder, "collects_layer_outputs", None)
        self._compiled: set[Hashable] = set()

    def compiled_forward(self, path: str, buffers: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The graph forward with its compiled part: the repeated blocks, or the whole."""
        if self.compiled_blocks is not None:
            with self.compiled_blocks.installed():
                return self.encoder.graph_forward(path, buffers)
        with specialized_floats():
            return self._compiled_whole(path, buffers)

    # The protocol's methods are spelled out: isinstance checks of runtime
    # protocols look them up statically (Python >= 3.12), past __getattr__.

    def graph_config(self) -> EncoderGraphConfig:
        return self.encoder.graph_config()

    def token_budget_range(self, path: str) -> tuple[int, int]:
        return self.encoder.token_budget_range(path)

    def inputs_from_call(self, args: tuple, kwargs: dict) -> Any:
        return self.encoder.inputs_from_call(args, kwargs)

    def item_specs(self, inputs: Any) -> list[ItemSpec]:
        return self.encoder.item_specs(inputs)

    def select_items(self, inputs: Any, indices: Sequence[int]) -> Any:
        return self.encoder.select_items(inputs, indices)

    def graph_signature(self, inputs: Any) -> Hashable:
        return self.encoder.graph_signature(inputs)

    def capture_inputs(self, spec: CaptureSpec) -> dict[str, torch.Tensor]:
        return self.encoder.capture_inputs(spec)

    def replay_inputs(self, path: str, inputs: Any) -> dict[str, torch.Tensor]:
        return self.encoder.replay_inputs(path, inputs)

    def eager_forward(self, path: str, inputs: Any) -> torch.Tensor:
        return self.encoder.eager_forward(path, inputs)

    def postprocess(self, outputs: list[dict[str, torch.Tensor]], inputs: Any) -> Any:
        return self.encoder.postprocess(outputs, inputs)

    def graph_forward(self, path: str, buffers: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The wrapped encoder's graph forward, compiled while :attr:`started`."""
        # With the blocks compiled, a graph collecting per-layer outputs in a list would
        # recompile the block for every block (dynamo guards the list's length): such a
        # graph captures the adapter's own forward.
        collects = self._collects_layer_outputs
        if not self.started or (
            self.compiled_blocks is not None and collects is not None and collects(path, buffers)
        ):
            return self.encoder.graph_forward(path, buffers)
        # What one compile serves: the path, and with static shapes its buffers' shapes.
        compiled_for: Hashable = path
        if self.static_shapes:
            compiled_for = path, tuple((name, tuple(t.shape)) for name, t in buffers.items())
        if compiled_for in self._compiled:
            return self.compiled_forward(path, buffers)
        began = time.perf_counter()
        output = self.compiled_forward(path, buffers)
        seconds = time.perf_counter() - began
        self.compile_seconds += seconds
        self._compiled.add(compiled_for)
        if self.on_compile is not None:
            self.on_compile(seconds)
        return output

    def give_up(self, reason: str) -> None:
        """Stop compiling for good, warning with ``reason``."""
        self.compile_error = reason
        self.started = False
        warnings.warn(
            f"compiling {type(self.encoder).__name__}'s graph forward was given up "
            f"({reason[:300]}); graphs capture the uncompiled forward",
            RuntimeWarning,
            stacklevel=3,
        )
        if self.on_give_up is not None:
            self.on_give_up()

    @functools.cached_property
    def _compiled_whole(self) -> Callable:
        """The adapter's whole graph forward, compiled at first use (the first
        ``torch.compile`` imports dynamo: seconds)."""
        return self._compile_function(self.encoder.graph_forward)

    def __getattr__(self, name: str) -> Any:
        # Only called for what this class lacks: the adapter's own attributes (``tower``).
        if name == "encoder":
            raise AttributeError(name)
        return getattr(self.encoder, name)
