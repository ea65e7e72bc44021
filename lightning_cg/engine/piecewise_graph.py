"""PiecewiseGraph: a split graph forward prepared on static buffers and run.

Values crossing stages sit at fixed addresses. Outputs only later pieces read stay in
the pool; once their last reader is captured the pool may reuse them (pieces replay in
capture order). Values eager stages touch live in *slots* outside the pool, reused by
stages never alive together, so memory grows with the tower's width, not its depth.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_leaves

from lightning_cg.engine.faults import capturing
from lightning_cg.engine.piecewise import PiecewiseSplit, PiecewiseUnsupported, Stage


class PiecewiseGraph:
    """A split prepared on one set of static buffers: pieces captured, slots allocated.

    ``split`` comes from :func:`split_graph_forward` on buffers of these shapes; ``pool``
    None runs the pieces eagerly (no CUDA). Build and run it where the graphs replay.
    """

    def __init__(
        self, split: PiecewiseSplit, buffers: Mapping[str, torch.Tensor], pool: Any = None
    ) -> None:
        self.split = split
        #: Values every run reads at fixed addresses: buffers, slots, the output.
        self._static: dict[fx.Node, Any] = {
            node: buffers[name]
            for node, name in zip(split.placeholders, split.input_names, strict=True)
        }
        self._slots: list[torch.Tensor] = []
        self._steps: list[_Step] = []
        self._slotted = {value for stage in split.stages if stage.eager for value in stage.inputs}
        live = dict(self._static)
        for index, stage in enumerate(split.stages):
            args = [live[value] for value in stage.inputs]
            live.update(zip(stage.outputs, self._prepare(stage, args, live, pool), strict=True))
            for value in [value for value in live if split.last_use.get(value, math.inf) <= index]:
                if value is not split.output:
                    # Its last reader is captured: the pool may hand its memory to later pieces.
                    del live[value]
        self._static[split.output] = live[split.output]

    @property
    def num_graphs(self) -> int:
        """CUDA graphs captured (0 without CUDA)."""
        return sum(step.graph is not None for step in self._steps)

    def run(self) -> torch.Tensor:
        """Replay the pieces and run the splitting ops on the buffers' current values; the
        output is a fixed tensor the next run overwrites."""
        values = dict(self._static)
        for step in self._steps:
            step(values)
        return values[self.split.output]

    def _prepare(
        self, stage: Stage, args: list[Any], live: dict[fx.Node, Any], pool: Any
    ) -> list[Any]:
        """Run or capture ``stage`` once; its outputs, those eager stages touch in slots."""
        captured = pool is not None and not stage.eager
        if captured:
            with side_stream():  # the outputs tell the slots' layouts
                for _ in range(2):
                    outputs = stage.module(*args)
        else:
            outputs = stage.module(*args)
        # Eager stages touch every output of their own, and what they read of a piece's.
        touched = set(stage.outputs) if stage.eager else self._slotted
        slotted = {i: out for i, out in enumerate(outputs) if stage.outputs[i] in touched}
        step = _Step(stage, self._slots_for(slotted, live, stage))
        if captured:
            step.graph = torch.cuda.CUDAGraph()
            with capturing(), torch.cuda.graph(step.graph, pool=pool):
                outputs = step.call(*args)
            # Capture runs nothing: replay once so the next eager stage reads real values.
            step.graph.replay()
        else:
            step.copy_to_slots(outputs)
        self._steps.append(step)
        self._static.update((stage.outputs[index], slot) for index, slot in step.slots.items())
        return [step.slots.get(index, out) for index, out in enumerate(outputs)]

    def _slots_for(
        self, outputs: dict[int, Any], live: dict[fx.Node, Any], stage: Stage
    ) -> dict[int, torch.Tensor]:
        """A slot per output: a free one of its layout (no live value shares its storage),
        else a new one."""
        busy = {
            tensor.untyped_storage().data_ptr()
            for tensor in tree_leaves(list(live.values()))
            if isinstance(tensor, torch.Tensor)
        }
        slots = {}
        for index, output in outputs.items():
            if not isinstance(output, torch.Tensor):
                raise PiecewiseUnsupported(
                    f"{stage.outputs[index].name} crosses a split as a {type(output).__name__}; "
                    "only tensors can pass between a graph piece and a splitting op"
                )
            layout = _layout(output)
            free = (s for s in self._slots if s.untyped_storage().data_ptr() not in busy)
            slot = next((s for s in free if _layout(s) == layout), None)
            if slot is None:
                slot = torch.empty_like(output)
                self._slots.append(slot)
            busy.add(slot.untyped_storage().data_ptr())
            slots[index] = slot
        return slots


class _Step:
    """Replays one graph piece; without a graph (a splitting op, or no CUDA), runs the
    stage on the current values."""

    def __init__(self, stage: Stage, slots: dict[int, torch.Tensor]) -> None:
        self.stage = stage
        self.slots = slots
        self.graph: torch.cuda.CUDAGraph | None = None

    def call(self, *args: Any) -> Sequence[Any]:
        """Run the stage and copy into the slots what eager stages touch."""
        outputs = self.stage.module(*args)
        self.copy_to_slots(outputs)
        return outputs

    def copy_to_slots(self, outputs: Sequence[Any]) -> None:
        for index, slot in self.slots.items():
            slot.copy_(outputs[index])

    def __call__(self, values: dict[fx.Node, Any]) -> None:
        if self.graph is not None:
            self.graph.replay()
            return
        outputs = self.call(*(values[value] for value in self.stage.inputs))
        for index, (value, output) in enumerate(zip(self.stage.outputs, outputs, strict=True)):
            if index not in self.slots:
                values[value] = output


def _layout(tensor: torch.Tensor) -> tuple:
    # The layout empty_like would give: what a slot for this tensor looks like.
    meta = torch.empty_like(tensor, device="meta")
    return tuple(meta.shape), meta.stride(), tensor.dtype, tensor.device


@contextmanager
def side_stream() -> Iterator[None]:
    """Run the ``with`` body on a side stream, so lazy initialisation stays out of graphs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        yield
    torch.cuda.current_stream().wait_stream(side)
