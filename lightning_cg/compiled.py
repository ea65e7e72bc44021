"""Compiled capture: the manager captures a torch.compile'd graph forward.

Inductor fuses the tower's small ops into fewer, larger kernels; a CUDA graph
captured over them replays fewer kernels than one over the eager forward
(DESIGN.md, issue 5: one 1024-patch image in 0.99 ms against 1.49 ms). The
adapter's ``compile_shapes`` says how: ``dynamic`` compiles once with symbolic
sizes, so a packed tower's many budgets reuse the same code; ``static``
compiles the first budget's shapes as they are (faster kernels, a shorter
compile) and leaves a second budget to torch.compile's automatic dynamic
shapes. The mode is the default: the manager does the graphing, so inductor's
own cudagraphs (``reduce-overhead``) stay off. ``compile_scope`` says what is
compiled: the tower's repeated blocks, once for all of them
(:mod:`lightning_cg.compile_regions`), or the whole graph forward.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch

from lightning_cg.compile_regions import CompiledBlocks, blocks_to_compile
from lightning_cg.dispatcher import GraphMode
from lightning_cg.encoder import CaptureSpec, EncoderGraphConfig, GraphableEncoder, ItemSpec


def check_compile(compile: bool, mode: GraphMode) -> bool:
    """``compile`` if ``mode`` can capture a compiled graph forward.

    Raises:
        ValueError: ``compile`` is on and ``mode`` splits the graph forward into
            pieces (PIECEWISE), which a compiled forward cannot be.
    """
    if compile and mode.requires_piecewise():
        raise ValueError(
            "compile=True captures the whole compiled graph forward; mode "
            f"{mode.value!r} splits it into pieces. Use compile=False, or a mode without "
            "pieces: none, full, full_uniform_only"
        )
    return compile


class CompiledEncoder:
    """A :class:`~lightning_cg.encoder.GraphableEncoder` whose graph forward is compiled.

    Every method but :meth:`graph_forward` calls the wrapped encoder's, so the
    eager path, the item specs and the buffers stay as they are. Compilation
    happens at the first graph forward of each path (the manager's warm-up
    before capture), and with static shapes also at the first graph forward of
    a path's new buffer shapes; :attr:`compile_seconds` adds up those calls.

    Args:
        encoder: the adapter to wrap.
        backend: the ``torch.compile`` backend; ``inductor`` generates the
            fused kernels, ``eager`` / ``aot_eager`` (or a callable) only trace
            (for tests).
        on_compile: called with the seconds of each graph forward that may compile.
        scope: a :data:`~lightning_cg.compile_regions.COMPILE_SCOPES` value: what
            is compiled, the tower's repeated blocks or the whole graph forward.

    Example:
        >>> manager = EncoderGraphManager(CompiledEncoder(PackedEncoderAdapter(tower)))
        >>> # or: EncoderGraphManager(PackedEncoderAdapter(tower), compile=True)
    """

    def __init__(
        self,
        encoder: GraphableEncoder,
        backend: str | Callable = "inductor",
        on_compile: Callable[[float], None] | None = None,
        scope: str = "auto",
    ) -> None:
        if not isinstance(encoder, GraphableEncoder):
            raise TypeError(
                "encoder must implement lightning_cg.encoder.GraphableEncoder; "
                f"got {type(encoder)!r}"
            )
        self.encoder = encoder
        #: Whether a path's new buffer shapes compile (``compile_shapes="static"``).
        self.static_shapes = encoder.graph_config().compile_shapes == "static"
        compile_function = functools.partial(
            torch.compile,
            # None: torch.compile's automatic dynamic shapes, static until a size changes.
            dynamic=None if self.static_shapes else True,
            fullgraph=False,
            mode=None,
            backend=backend,
        )
        tower = getattr(encoder, "tower", None)
        blocks = blocks_to_compile(tower, scope, dynamic_shapes=not self.static_shapes)
        #: The compiled repeated blocks; None when the whole graph forward is compiled.
        self.compiled_blocks = CompiledBlocks(blocks, compile_function) if blocks else None
        if self.compiled_blocks is None:
            self.compiled_forward = compile_function(encoder.graph_forward)
        else:
            self.compiled_forward = self._forward_with_compiled_blocks
        #: Seconds of the graph forwards that may compile: compilation, mostly.
        self.compile_seconds = 0.0
        self.on_compile = on_compile
        self._compiled: set[Hashable] = set()

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
        """The wrapped encoder's graph forward, compiled."""
        compiled_for = self._compiled_for(path, buffers)
        if compiled_for in self._compiled:
            return self.compiled_forward(path, buffers)
        started = time.perf_counter()
        output = self.compiled_forward(path, buffers)
        seconds = time.perf_counter() - started
        self.compile_seconds += seconds
        self._compiled.add(compiled_for)
        if self.on_compile is not None:
            self.on_compile(seconds)
        return output

    def _forward_with_compiled_blocks(
        self, path: str, buffers: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        with self.compiled_blocks.installed():
            return self.encoder.graph_forward(path, buffers)

    def _compiled_for(self, path: str, buffers: Mapping[str, torch.Tensor]) -> Hashable:
        """What one compile serves: the path, and with static shapes its buffers' shapes.

        With static shapes, the third and later shapes of a path reuse the
        second's symbolic code; their first forward counts all the same (one
        forward's time, where a compile takes seconds).
        """
        if not self.static_shapes:
            return path
        return path, tuple((name, tuple(tensor.shape)) for name, tensor in buffers.items())

    def __getattr__(self, name: str) -> Any:
        # Only called for what this class lacks: the adapter's own attributes
        # (e.g. ``tower``).
        if name == "encoder":
            raise AttributeError(name)
        return getattr(self.encoder, name)
