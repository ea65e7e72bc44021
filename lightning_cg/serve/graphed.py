"""``graphed``: a tower's forward through budget-batched graph replay, without Lightning.

Example::

    with torch.inference_mode(), graphed(tower, capture="first_use") as served:
        for images in loader:
            features = tower(images)
    print(served.stats["hits"])
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_cg.adapters import (
    GRAPHED_FORWARD,
    adapter_for,
    check_adapter_serves,
    check_config_applies,
    foreign_forward,
    foreign_forward_message,
    graphed_forward_for,
)
from lightning_cg.engine.config import GraphConfig
from lightning_cg.engine.encoder import GraphableEncoder
from lightning_cg.engine.manager import EncoderGraphManager


class GraphedTower:
    """What :func:`graphed` returns: each ``with`` routes the tower's forward through a new
    :class:`~lightning_cg.engine.manager.EncoderGraphManager` (``manager``) of ``adapter``."""

    def __init__(self, tower: nn.Module, adapter: GraphableEncoder, config: GraphConfig) -> None:
        self.tower = tower
        self.manager: EncoderGraphManager | None = None
        self._adapter = adapter
        self._config = config
        #: Whether the tower's forward is the graphed one (inside the ``with``).
        self._swapped = False

    @property
    def stats(self) -> dict[str, float]:
        """The manager's counters (see :class:`~lightning_cg.core.stats.GraphStats`); {} before."""
        return {} if self.manager is None else self.manager.stats.as_dict()

    def __enter__(self) -> GraphedTower:
        tower = self.tower
        if getattr(tower.__dict__.get("forward"), GRAPHED_FORWARD, False):
            # The inner exit would put back the outer's patch, not the tower's forward.
            raise RuntimeError(
                f"{type(tower).__name__} is already inside graphed(...): nest no second "
                "graphed(...) on the same tower; use the outer one"
            )
        if foreign_forward(tower) is not None:
            raise RuntimeError(foreign_forward_message(tower, "graphed"))
        # Built before the forward changes: a ladder that cannot work leaves the tower as it was.
        manager = EncoderGraphManager(self._adapter, self._config)
        manager.begin_run()

        self._swapped = True
        self.manager = manager
        # Grad-enabled calls run eagerly inside execute: graphs hold no autograd state.
        tower.forward = graphed_forward_for(tower, manager.encoder, manager.execute)
        return self

    def __exit__(self, *exc_info: object) -> None:
        # Runs for every exception, KeyboardInterrupt included; swallows none.
        if self._swapped:
            del self.tower.forward  # the class's forward: a tower with its own is refused
            self._swapped = False
            self.manager.write_plan()


def graphed(
    tower: nn.Module,
    *,
    adapter: Any = None,
    config: GraphConfig | None = None,
    **options: Any,
) -> GraphedTower:
    """Serve ``tower`` through budget-batched CUDA graph replay inside a ``with`` block.

    Inside, calls replay graphs where a budget fits and run eagerly elsewhere, returning the
    tower's own output; leaving, also by an exception, puts back the forward that was there.
    With ``plan="file.json"`` what the capture rule learned is read on entering (if the
    file exists) and written on leaving, so a later process captures known keys at once.
    Calls with gradients enabled, or with the tower in train mode, run eagerly (use
    ``torch.inference_mode()`` and ``tower.eval()``).

    Args:
        adapter: as for :func:`~lightning_cg.adapters.adapter_for`; built here, once, and an
            adapter object must wrap ``tower``.
        config: every graph option as one :class:`~lightning_cg.engine.config.GraphConfig`.
        **options: GraphConfig fields instead of ``config`` (``mode``, ``budgets``, ...);
            None takes the field's default.

    Raises TypeError for a ``tower`` that is no module, ValueError for a bad option or
    adapter, and what ``adapter_for`` raises; on entering, RuntimeError when it is already
    inside ``graphed`` or its forward is set on the instance by another wrapper, and what
    the manager raises for budgets the tower cannot use.
    """
    if not isinstance(tower, nn.Module):
        raise TypeError(f"graphed serves a torch.nn.Module's forward; got {type(tower).__name__}")
    graph_config = GraphConfig.from_config_or_options(config, options)
    check_adapter_serves(adapter, tower, "the tower passed to graphed")
    encoder = adapter_for(tower, adapter)
    check_config_applies(encoder, graph_config)
    return GraphedTower(tower, encoder, graph_config)
