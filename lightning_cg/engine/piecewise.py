"""Piecewise graphs: a tower's graph forward split at its attention ops.

The forward is traced with ``make_fx`` in pre-dispatch mode, which keeps attention ops
as single nodes, and cut at every splitting op into stages: graph pieces, and between
them the splitting ops, which run eagerly at every replay on the metadata the buffers
then hold. :class:`~lightning_cg.engine.piecewise_graph.PiecewiseGraph` runs a split.
"""

from __future__ import annotations

import operator
import os
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

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
    """Normalise op names to ``namespace::name`` (``namespace.name`` is accepted too)."""
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


def check_ops_registered(splitting_ops: Sequence[str]) -> None:
    """Refuse an op name of ``splitting_ops`` that no loaded library registered (the
    defaults are left out: older torch versions lack some)."""
    unknown = [
        name
        for name in splitting_ops
        if name not in DEFAULT_SPLITTING_OPS and not _op_registered(name)
    ]
    if unknown:
        raise ValueError(
            f"splitting_ops names {unknown}, which no loaded library registered as a torch "
            "op; import the library that defines it first, or name ops such as "
            f"{', '.join(DEFAULT_SPLITTING_OPS)}"
        )


def _op_registered(name: str) -> bool:
    namespace, _, op_name = name.partition("::")
    try:
        getattr(getattr(torch.ops, namespace), op_name)
    except (AttributeError, RuntimeError):
        return False
    return True


def check_piecewise_fallback(fallback: str) -> str:
    """``fallback`` if it is one of :data:`PIECEWISE_FALLBACKS`, else a ValueError naming them."""
    if fallback not in PIECEWISE_FALLBACKS:
        raise ValueError(
            f"piecewise_fallback must be one of {', '.join(PIECEWISE_FALLBACKS)}; got {fallback!r}"
        )
    return fallback


@dataclass(frozen=True)
class Stage:
    """One stage of a split: a graph piece, or (``eager``) one splitting op with
    the items it unpacks."""

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
    stages: tuple[Stage, ...]
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

    The trace runs the forward once, so call it where the pieces will run (device, grad
    mode, autocast). ``name`` says what ``forward`` is in error messages.

    Raises:
        PiecewiseUnsupported: tracing stopped, no splitting op was found, or the
            forward does not return one tensor.
    """
    ops = set(check_splitting_ops(splitting_ops))
    module = _trace(forward, buffers, name)
    graph = module.graph
    (output,) = (node.args[0] for node in graph.nodes if node.op == "output")
    if not isinstance(output, fx.Node) or output.op not in ("call_function", "placeholder"):
        raise PiecewiseUnsupported(f"{name} must return one tensor computed from the buffers")
    stage_of, eager = _assign_stages(graph, ops)
    if not any(eager):
        raise PiecewiseUnsupported(_no_split_message(graph, ops, name))
    members: list[list[fx.Node]] = [[] for _ in eager]
    for node, index in stage_of.items():  # in graph order
        members[index].append(node)
    stages = tuple(
        _build_stage(module, nodes, is_eager)
        for nodes, is_eager in zip(members, eager, strict=True)
        if nodes
    )
    last_use = {value: index for index, stage in enumerate(stages) for value in stage.inputs}
    placeholders = tuple(node for node in graph.nodes if node.op == "placeholder")
    return PiecewiseSplit(tuple(buffers), placeholders, stages, output, last_use)


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


def _assign_stages(graph: fx.Graph, ops: set[str]) -> tuple[dict[fx.Node, int], list[bool]]:
    """Stage index per computing node; stage ``i`` is eager iff ``eager[i]``.

    Each splitting op gets an eager stage, then a graph stage follows. An item taken out
    of a tuple stays with the node that made it, so only tensors cross stages.
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


def _build_stage(module: fx.GraphModule, nodes: list[fx.Node], eager: bool) -> Stage:
    """A GraphModule of ``nodes`` taking what they read from other stages and returning
    what other stages (or the output) read from them."""
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
    return Stage(fx.GraphModule(module, graph), tuple(inputs), outputs, eager)
