"""Piecewise graphs: a tower's graph forward split at its attention ops.

The graph forward is traced once per static buffer set with ``make_fx`` in
pre-dispatch mode, which keeps ``scaled_dot_product_attention`` (and custom ops
such as the variable-length flash attention) as single nodes while Python
control flow is resolved on the real buffers. The trace is cut at every
splitting op into stages: graph pieces, captured as CUDA graphs in the caller's
memory pool, and between them the splitting ops, which run eagerly at every
replay and so read the metadata (``cu_seqlens``) the buffers hold at that time.

Values that cross a stage boundary must sit at fixed addresses. A piece's
outputs that only later pieces read stay in the pool, at the addresses the
later captures baked in; once their last reader is captured the pool may reuse
their memory, which is safe because pieces always replay in capture order.
Values an eager stage reads or writes live in *slots*: tensors outside the
pool, reused between stages whose values are never alive at the same time, so
the memory of a split grows with the widest point of the tower, not its depth.

Without CUDA the same stages run eagerly, slots included, so CPU tests cover
everything but the capture.

Example:
    >>> from lightning_cg.adapters.packed import PackedEncoderAdapter
    >>> from lightning_cg.encoder import CaptureSpec
    >>> from lightning_cg.models.packed_vit import PackedViT, PackedViTConfig
    >>> config = PackedViTConfig(hidden_size=64, depth=2, num_heads=4, patch_size=4,
    ...                          out_hidden_size=32)
    >>> adapter = PackedEncoderAdapter(PackedViT(config))
    >>> spec = CaptureSpec("local", 16, 4, 4, (torch.float32, torch.device("cpu")))
    >>> buffers = adapter.capture_inputs(spec)
    >>> with torch.no_grad():
    ...     split = split_graph_forward(lambda b: adapter.graph_forward("local", b), buffers)
    ...     graph = PiecewiseGraph(split, buffers)  # pool=None: no CUDA, pieces run eagerly
    ...     tokens = graph.run()
    >>> split.num_pieces, split.num_splits, tuple(tokens.shape)
    (3, 2, (16, 32))
"""

from __future__ import annotations

import math
import operator
import os
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_leaves

from lightning_cg.faults import capturing

#: Ops a tower is split at, as ``namespace::name``.
DEFAULT_SPLITTING_OPS = (
    "aten::scaled_dot_product_attention",
    "torch_attn::_varlen_attn",  # torch.nn.attention.varlen.varlen_attn
    # nn.MultiheadAttention's fused inference kernel, should a trace ever reach it.
    "aten::_native_multi_head_attention",
)
#: What a manager does when a tower cannot be split: raise, run eagerly, or use FULL graphs.
PIECEWISE_FALLBACKS = ("error", "eager", "full")

_TORCH_DIR = os.path.dirname(torch.__file__)
#: Op names that hint at an attention the splitting ops missed.
_ATTENTION_HINTS = ("attention", "attn", "softmax")

Forward = Callable[[Mapping[str, torch.Tensor]], torch.Tensor]


class PiecewiseUnsupported(RuntimeError):
    """A graph forward cannot be traced or split; the message names the op or line."""


def check_splitting_ops(splitting_ops: Sequence[str]) -> tuple[str, ...]:
    """Normalise op names to ``namespace::name`` (``namespace.name`` is accepted too).

    Raises:
        ValueError: ``splitting_ops`` is empty or an entry has no namespace.
    """
    if isinstance(splitting_ops, str) or not splitting_ops:
        raise ValueError(
            f"splitting_ops must be a non-empty list of op names like "
            f"'aten::scaled_dot_product_attention'; got {splitting_ops!r}"
        )
    names = []
    for op in splitting_ops:
        name = op.replace(".", "::", 1) if isinstance(op, str) and "::" not in op else op
        namespace, _, op_name = name.partition("::") if isinstance(name, str) else ("", "", "")
        if not (namespace.isidentifier() and op_name.isidentifier()):
            raise ValueError(
                f"splitting_ops entry {op!r} is not an op name 'namespace::name' (no overload), "
                "e.g. 'aten::scaled_dot_product_attention' or 'torch_attn::_varlen_attn'"
            )
        names.append(name)
    return tuple(names)


def check_piecewise_fallback(fallback: str) -> str:
    """``fallback`` if it is one of :data:`PIECEWISE_FALLBACKS`, else a ValueError naming them."""
    if fallback not in PIECEWISE_FALLBACKS:
        raise ValueError(
            f"piecewise_fallback must be one of {', '.join(PIECEWISE_FALLBACKS)}; got {fallback!r}"
        )
    return fallback


@dataclass(frozen=True)
class _Stage:
    """A graph piece, or (``eager``) one splitting op with the items it unpacks."""

    module: fx.GraphModule
    inputs: tuple[fx.Node, ...]
    outputs: tuple[fx.Node, ...]
    eager: bool


@dataclass(frozen=True)
class PiecewiseSplit:
    """A traced graph forward cut into stages.

    Attributes:
        input_names: the buffer each placeholder of the trace reads, in order.
        placeholders: the trace's inputs.
        stages: graph pieces and eager splitting ops in execution order.
        output: the value the graph forward returns.
        last_use: per value, the index of the last stage that reads it.
    """

    input_names: tuple[str, ...]
    placeholders: tuple[fx.Node, ...]
    stages: tuple[_Stage, ...]
    output: fx.Node
    last_use: Mapping[fx.Node, int]

    @property
    def num_pieces(self) -> int:
        """Stages captured as graphs: the code between splitting ops."""
        return sum(not stage.eager for stage in self.stages)

    @property
    def num_splits(self) -> int:
        """Stages that run eagerly: one per splitting op."""
        return sum(stage.eager for stage in self.stages)


def split_graph_forward(
    forward: Forward,
    buffers: Mapping[str, torch.Tensor],
    splitting_ops: Sequence[str] = DEFAULT_SPLITTING_OPS,
    name: str = "the graph forward",
) -> PiecewiseSplit:
    """Trace ``forward(buffers)`` and cut it at every splitting op.

    The trace runs the forward once on the buffers, so call it where the
    pieces will run (device, grad mode, autocast); shapes are those of the buffers.

    Args:
        forward: the tower's graph forward on a dict of static buffers.
        buffers: the static buffers; their values must be valid inputs.
        splitting_ops: op names, see :func:`check_splitting_ops`.
        name: what ``forward`` is, for error messages.

    Raises:
        PiecewiseUnsupported: the trace stopped (the message names the op and the
            tower's line), found no splitting op, or the forward does not return
            one tensor.
    """
    ops = set(check_splitting_ops(splitting_ops))
    module = _trace(forward, buffers, name)
    return _split(module, tuple(buffers), ops, name)


def _trace(forward: Forward, buffers: Mapping[str, torch.Tensor], name: str) -> fx.GraphModule:
    names = list(buffers)

    def flat_forward(*tensors: torch.Tensor) -> torch.Tensor:
        return forward(dict(zip(names, tensors, strict=True)))

    try:
        return make_fx(flat_forward, pre_dispatch=True)(*buffers.values())
    except Exception as error:
        raise PiecewiseUnsupported(
            f"cannot trace {name} for piecewise graphs: tracing stopped at "
            f"{_tower_line(error)}: {error}"
        ) from error


def _tower_line(error: BaseException) -> str:
    """The innermost frame outside torch: the tower's line that made tracing fail."""
    frames = [
        frame
        for frame in traceback.extract_tb(error.__traceback__)
        if not frame.filename.startswith(_TORCH_DIR)
    ]
    if not frames:
        return "a line inside torch"
    frame = frames[-1]
    return f"{frame.filename}:{frame.lineno} in {frame.name} ({(frame.line or '').strip()})"


def _op_name(node: fx.Node) -> str | None:
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return schema.name if schema is not None else None


def _split(
    module: fx.GraphModule, input_names: tuple[str, ...], ops: set[str], name: str
) -> PiecewiseSplit:
    graph = module.graph
    output = _single_output(graph, name)
    stage_of, eager = _assign_stages(graph, ops)
    if not any(eager):
        raise PiecewiseUnsupported(_no_split_message(graph, ops, name))
    members: list[list[fx.Node]] = [[] for _ in eager]
    for node in graph.nodes:
        if node in stage_of:
            members[stage_of[node]].append(node)
    stages = tuple(
        _build_stage(module, nodes, is_eager)
        for nodes, is_eager in zip(members, eager, strict=True)
        if nodes
    )
    last_use = {value: index for index, stage in enumerate(stages) for value in stage.inputs}
    placeholders = tuple(node for node in graph.nodes if node.op == "placeholder")
    return PiecewiseSplit(input_names, placeholders, stages, output, last_use)


def _single_output(graph: fx.Graph, name: str) -> fx.Node:
    (result,) = (node.args[0] for node in graph.nodes if node.op == "output")
    if not isinstance(result, fx.Node) or result.op not in ("call_function", "placeholder"):
        raise PiecewiseUnsupported(f"{name} must return one tensor computed from the buffers")
    return result


def _assign_stages(graph: fx.Graph, ops: set[str]) -> tuple[dict[fx.Node, int], list[bool]]:
    """Stage index per computing node; stage ``i`` is eager iff ``eager[i]``.

    Each splitting op opens an eager stage of its own and a graph stage after
    it. An item taken out of a tuple or list stays with the node that made it,
    so only tensors cross stage boundaries.
    """
    stage_of: dict[fx.Node, int] = {}
    eager = [False]
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue  # inputs, outputs and constants (copied into each stage that reads them)
        source = node.args[0] if node.args else None
        if node.target is operator.getitem and source in stage_of:
            stage_of[node] = stage_of[source]
        elif _op_name(node) in ops:
            eager += [True, False]
            stage_of[node] = len(eager) - 2
        else:
            stage_of[node] = len(eager) - 1
    return stage_of, eager


def _no_split_message(graph: fx.Graph, ops: set[str], name: str) -> str:
    seen = sorted({op for node in graph.nodes if (op := _op_name(node)) is not None})
    hints = [op for op in seen if any(hint in op for hint in _ATTENTION_HINTS)]
    return (
        f"cannot split {name} for piecewise graphs: it calls none of the splitting ops "
        f"{sorted(ops)}. Ops it calls that look like attention: {hints or 'none'}; "
        "add the tower's attention op to splitting_ops."
    )


def _build_stage(module: fx.GraphModule, nodes: list[fx.Node], eager: bool) -> _Stage:
    """A GraphModule of ``nodes`` taking what they read from other stages, returning
    what other stages (or the forward's output) read from them."""
    inside = set(nodes)
    inputs: dict[fx.Node, None] = {}
    for node in nodes:
        for value in node.all_input_nodes:
            if value not in inside and value.op != "get_attr":
                inputs[value] = None
    outputs = tuple(node for node in nodes if any(user not in inside for user in node.users))
    graph = fx.Graph()
    env = {value: graph.placeholder(value.name) for value in inputs}
    for node in nodes:
        for value in node.all_input_nodes:
            if value.op == "get_attr" and value not in env:
                env[value] = graph.node_copy(value)
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[node] for node in outputs))
    return _Stage(fx.GraphModule(module, graph), tuple(inputs), outputs, eager)


class PiecewiseGraph:
    """A split prepared on one set of static buffers: pieces captured, slots allocated.

    Args:
        split: from :func:`split_graph_forward` on these buffers (or buffers of
            the same shapes).
        buffers: the static buffers the caller fills before each :meth:`run`.
        pool: a CUDA graph memory pool; None runs the pieces eagerly (no CUDA).

    Build and run it where the graphs replay (grad mode, autocast).
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
        self._steps: list[_PieceStep | _EagerStep] = []
        self._slotted = {value for stage in split.stages if stage.eager for value in stage.inputs}
        live = dict(self._static)
        for index, stage in enumerate(split.stages):
            args = [live[value] for value in stage.inputs]
            prepare = self._prepare_eager if stage.eager else self._prepare_piece
            live.update(zip(stage.outputs, prepare(stage, args, live, pool), strict=True))
            for value in [value for value in live if split.last_use.get(value, math.inf) <= index]:
                if value is not split.output:
                    # Its last reader is captured: the pool may hand its memory to later pieces.
                    del live[value]
        self._static[split.output] = live[split.output]

    @property
    def num_graphs(self) -> int:
        """CUDA graphs captured (0 without CUDA)."""
        return sum(isinstance(step, _PieceStep) and step.graph is not None for step in self._steps)

    def run(self) -> torch.Tensor:
        """Replay the pieces and run the splitting ops on the buffers' current values.

        Returns:
            The graph forward's output; a fixed tensor the next run overwrites.
        """
        values = dict(self._static)
        for step in self._steps:
            step(values)
        return values[self.split.output]

    def _prepare_eager(
        self, stage: _Stage, args: list[Any], live: dict[fx.Node, Any], pool: Any
    ) -> list[torch.Tensor]:
        outputs = stage.module(*args)
        slots = self._slots_for(dict(enumerate(outputs)), live, stage)
        for index, slot in slots.items():
            slot.copy_(outputs[index])
        step = _EagerStep(stage, [slots[index] for index in range(len(outputs))])
        self._steps.append(step)
        self._static.update(zip(stage.outputs, step.slots, strict=True))
        return step.slots

    def _prepare_piece(
        self, stage: _Stage, args: list[Any], live: dict[fx.Node, Any], pool: Any
    ) -> list[Any]:
        outputs = stage.module(*args) if pool is None else _warm_up(stage.module, args)
        read_eagerly = {
            i: out for i, out in enumerate(outputs) if stage.outputs[i] in self._slotted
        }
        step = _PieceStep(stage, self._slots_for(read_eagerly, live, stage))
        if pool is None:
            step.copy_to_slots(outputs)
        else:
            step.graph, outputs = _capture(lambda: step.call(*args), pool)
            # Capture runs nothing: replay once so the next eager stage reads real values.
            step.graph.replay()
        self._steps.append(step)
        self._static.update((stage.outputs[index], slot) for index, slot in step.slots.items())
        return [step.slots.get(index, out) for index, out in enumerate(outputs)]

    def _slots_for(
        self, outputs: dict[int, Any], live: dict[fx.Node, Any], stage: _Stage
    ) -> dict[int, torch.Tensor]:
        """A slot per output: a free one of its layout, else a new one.

        A slot is free when no live value shares its storage.
        """
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
            slot = self._free_slot(output, busy)
            if slot is None:
                slot = self._new_slot(output)
            busy.add(slot.untyped_storage().data_ptr())
            slots[index] = slot
        return slots

    def _free_slot(self, template: torch.Tensor, busy: set[int]) -> torch.Tensor | None:
        layout = _layout(template)
        for slot in self._slots:
            if _layout(slot) == layout and slot.untyped_storage().data_ptr() not in busy:
                return slot
        return None

    def _new_slot(self, template: torch.Tensor) -> torch.Tensor:
        slot = torch.empty_like(template)
        self._slots.append(slot)
        return slot


class _PieceStep:
    """Replays one graph piece; without a graph, runs it on the current values."""

    def __init__(self, stage: _Stage, slots: dict[int, torch.Tensor]) -> None:
        self.stage = stage
        self.slots = slots
        self.graph: torch.cuda.CUDAGraph | None = None

    def call(self, *args: Any) -> Sequence[Any]:
        """Run the piece and copy into the slots what eager stages read."""
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


class _EagerStep:
    """Runs one splitting op on the values at fixed addresses; results go to slots."""

    def __init__(self, stage: _Stage, slots: list[torch.Tensor]) -> None:
        self.stage = stage
        self.slots = slots

    def __call__(self, values: dict[fx.Node, Any]) -> None:
        outputs = self.stage.module(*(values[value] for value in self.stage.inputs))
        for slot, output in zip(self.slots, outputs, strict=True):
            slot.copy_(output)


def _layout(tensor: torch.Tensor) -> tuple:
    # The layout empty_like would give: what a slot for this tensor looks like.
    meta = torch.empty_like(tensor, device="meta")
    return tuple(meta.shape), meta.stride(), tensor.dtype, tensor.device


def _warm_up(module: fx.GraphModule, args: list[Any]) -> Sequence[Any]:
    # On a side stream, so lazy initialisation (cuBLAS handles, autotuning)
    # stays out of the graph; the outputs tell the slots' layouts.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            outputs = module(*args)
    torch.cuda.current_stream().wait_stream(side)
    return outputs


def _capture(fn: Callable[[], Sequence[Any]], pool: Any) -> tuple[torch.cuda.CUDAGraph, Any]:
    graph = torch.cuda.CUDAGraph()
    with capturing(), torch.cuda.graph(graph, pool=pool):
        outputs = fn()
    return graph, outputs
