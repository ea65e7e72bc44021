"""Swaps a vision tower's forward for budget-batched CUDA graph replay outside training."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_cg.adapters import (
    AdapterFactory,
    AdapterName,
    adapter_for,
    check_adapter_serves,
    check_config_applies,
    foreign_forward,
    foreign_forward_message,
    graphed_forward_for,
)
from lightning_cg.callback.checks import (
    STAGES,
    StageName,
    check_batches_not_sharded,
    check_callback_args,
    check_one_callback_per_tower,
    check_sampler_setting,
    check_strategy,
    find_tower,
    is_compiled,
    resolve_module,
)
from lightning_cg.callback.progress import CaptureProgress
from lightning_cg.callback.report import (
    reduce_stats,
    report_costly_captures,
    report_cpu_path,
    report_rebinding,
    report_run,
)
from lightning_cg.callback.trainer_runs import total_batches, validation_runs_after
from lightning_cg.core.dispatcher import GraphMode
from lightning_cg.engine.binding import CHANGED, TensorBinding, tensor_layouts
from lightning_cg.engine.config import (
    BudgetConfig,
    CaptureName,
    GraphConfig,
    ModeName,
    weight_copies,
)
from lightning_cg.engine.encoder import GraphableEncoder
from lightning_cg.engine.manager import EncoderGraphManager
from lightning_cg.engine.parallel import execute_data_parallel


class CUDAGraphCallback(Callback):
    """Replays a vision tower through CUDA graphs in validation, test and prediction.

    On each configured stage's ``*_start`` the tower's forward becomes graph replay (eager
    where no budget fits); ``*_end``, ``teardown`` and exceptions put the original back, so
    training never runs through a graph. Graphs outlive the run (see ``engine.binding``).
    Under DDP a failed capture on any rank makes every rank eager from the next run on.

    Args:
        module: dotted path of the tower in the LightningModule; None finds the one vision
            tower at each run's start (after ``configure_model``), or the module an adapter
            object wraps, and stores its path here.
        stages: any of ``validate`` (a fit's validation too), ``test`` and ``predict``.
        adapter: ``packed``, ``batched``, ``hf``, a GraphableEncoder, or a callable that
            builds one from the tower; None picks one by the tower's type.
        encoder_data_parallel: ranks that all get the same batch each encode a share of it
            (:func:`~lightning_cg.engine.parallel.execute_data_parallel`).
        keep_graphs: keep graphs between runs; False frees them after each run.
        config: every graph option as one :class:`~lightning_cg.engine.config.GraphConfig`.
        mode, budgets, capture, compile, paths, max_items_per_batch, max_frames_per_batch,
            cast_weights_per_run, plan: the :class:`~lightning_cg.engine.config.GraphConfig` fields,
            not with ``config``; None takes the field's default. Typed, so LightningCLI takes
            each as ``--trainer.callbacks.<name>`` and refuses a value outside its choices.
        **options: refused, naming the options there are.

    Example::

        trainer = Trainer(callbacks=[CUDAGraphCallback(mode="full")])
        trainer.predict(model, datamodule)
    """

    def __init__(
        self,
        module: str | None = None,
        stages: Sequence[StageName] = STAGES,
        mode: ModeName | GraphMode | None = None,
        budgets: BudgetConfig | Mapping[str, Any] | None = None,
        capture: CaptureName | None = None,
        compile: bool | None = None,
        adapter: AdapterName | AdapterFactory | GraphableEncoder | None = None,
        encoder_data_parallel: bool = False,
        keep_graphs: bool = True,
        config: GraphConfig | None = None,
        *,
        paths: Mapping[str, BudgetConfig | Mapping[str, Any]] | None = None,
        max_items_per_batch: int | None = None,
        max_frames_per_batch: int | None = None,
        cast_weights_per_run: bool | None = None,
        plan: str | None = None,
        **options: Any,
    ) -> None:
        flags = {"keep_graphs": keep_graphs, "encoder_data_parallel": encoder_data_parallel}
        check_callback_args(module, stages, flags, adapter)
        self.module = module
        #: Whether setup finds the tower (module=None), each time: the model may differ.
        self._find_tower = module is None
        named = {
            "mode": mode,
            "budgets": budgets,
            "paths": paths,
            "capture": capture,
            "compile": compile,
            "max_items_per_batch": max_items_per_batch,
            "max_frames_per_batch": max_frames_per_batch,
            "cast_weights_per_run": cast_weights_per_run,
            "plan": plan,
        }
        #: The graph options, checked once, shared with the manager.
        self.config = GraphConfig.from_config_or_options(config, named | options)
        self.mode = self.config.mode
        self.stages = tuple(stages)
        self.keep_graphs = keep_graphs
        self.adapter = adapter
        self.encoder_data_parallel = encoder_data_parallel
        self.manager: EncoderGraphManager | None = None
        #: Stats of the last validation, test or predict run, summed over ranks.
        self.last_stats: dict[str, float] = {}
        self._tower: nn.Module | None = None
        self._binding: TensorBinding | None = None
        #: The tower's tensor layouts when keep_graphs=False last cleared its graphs.
        self._cleared_layouts: dict[str, tuple] | None = None
        #: Whether the tower's forward is the graphed one (a run is under way).
        self._swapped = False
        self._told_cpu = False
        self._capture_progress = CaptureProgress()
        #: The manager serving the current run: ``manager``, or the eager one.
        self._run_manager: EncoderGraphManager | None = None
        self._eager: EncoderGraphManager | None = None
        #: Whether a capture failed in an earlier run (on a manager since replaced too).
        self._capture_failed = False
        #: A checkpoint's state for the next manager built (``load_state_dict``).
        self._loaded_state: dict[str, Any] | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        check_strategy(trainer)

    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Find the tower and build its manager if the tower is new; at a run's start, when
        the module's ``setup`` and ``configure_model`` have built it (they run after
        callbacks' ``setup``), and before any batch."""
        if self._find_tower:
            self.module, tower = find_tower(pl_module, self.adapter)
        else:
            tower = resolve_module(pl_module, self.module)
        # The Trainer's enable_progress_bar=False silences the capture's bar too.
        self._capture_progress.enabled = trainer.progress_bar_callback is not None
        others = [callback for callback in trainer.callbacks if isinstance(callback, type(self))]
        check_one_callback_per_tower(self, others, pl_module, tower)
        if is_compiled(tower):
            rank_zero_warn(
                f"CUDAGraphCallback: {self.module!r} is compiled with torch.compile; "
                "leaving it alone (use mode='reduce-overhead' or drop torch.compile)."
            )
            self._tower = self.manager = self._binding = None
            return
        if foreign_forward(tower) is not None:
            where = f"CUDAGraphCallback ({self.module!r})"
            rank_zero_warn(foreign_forward_message(tower, where) + "; leaving it alone.")
            self._tower = self.manager = self._binding = None
            return
        check_adapter_serves(self.adapter, tower, f"the tower at module={self.module!r}")
        if self.manager is None or tower is not self._tower:
            # A new tower gets its own managers; a capture failure stays agreed (see
            # _agree_graphs_usable): the new tower runs eagerly through a manager of its own.
            self._tower = tower
            self._binding = self._cleared_layouts = self._eager = None
            self.manager = self._build_manager(tower, trainer)
            if self._loaded_state is not None:
                self.manager.load_state_dict(self._loaded_state, "the checkpoint")
                self._loaded_state = None
        elif self.manager.weight_casts is not None and not self._weight_copies(trainer):
            # A fit after runs that made weight copies: they go, with the graphs reading
            # them; what the capture rule learned stays.
            learned = self.manager.state_dict()
            self.manager.clear()
            self.manager = self._build_manager(tower, trainer)
            self.manager.load_state_dict(learned, "this callback's earlier runs")

    def _build_manager(
        self, tower: nn.Module, trainer: pl.Trainer, mode: GraphMode | None = None
    ) -> EncoderGraphManager:
        config = dataclasses.replace(self.config, cast_weights_per_run=self._weight_copies(trainer))
        if mode is not None:
            # The eager manager learns nothing worth a plan: only the graphing one reads it.
            config = dataclasses.replace(config, mode=mode, plan=None)
        adapter = adapter_for(tower, self.adapter)
        check_config_applies(adapter, config)
        return EncoderGraphManager(adapter, config, self._capture_progress)

    def _weight_copies(self, trainer: pl.Trainer) -> bool:
        """Whether graphs read weight copies: unless set, not in a fit, where they would hold
        device memory through every training step."""
        return weight_copies(self.config, trainer.state.fn == TrainerFn.FITTING)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Before training: a tower or data the callback cannot serve is refused before any work.
        if "validate" in self.stages:
            self._attach(trainer, pl_module)
            if self._data_parallel(trainer):
                check_sampler_setting(trainer)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The sanity check's few batches run eagerly: they check the loop, not the speed.
        if "validate" in self.stages and not trainer.sanity_checking:
            self._attach(trainer, pl_module)
            later_runs = validation_runs_after(trainer)
            self._swap_in(trainer, "validate", total_batches(trainer.num_val_batches), later_runs)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish_run(trainer, "validate")

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if "test" in self.stages:
            self._attach(trainer, pl_module)
            self._swap_in(trainer, "test", total_batches(trainer.num_test_batches))

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish_run(trainer, "test")

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if "predict" in self.stages:
            self._attach(trainer, pl_module)
            self._swap_in(trainer, "predict", total_batches(trainer.num_predict_batches))

    @override
    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish_run(trainer, "predict")

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self.restore()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.restore()

    def _swap_in(
        self,
        trainer: pl.Trainer,
        stage: str,
        expected_calls: int | None,
        later_runs: int | None = None,
    ) -> None:
        execute = self._executor(trainer, stage)
        # A collective: every rank takes part before any of them may return.
        graphs_usable = self._agree_graphs_usable(trainer)
        if self.manager is None or self._tower is None or self._swapped:
            return
        self._bind_tensors()
        if not self._told_cpu and not next(self._tower.parameters(), torch.empty(0)).is_cuda:
            report_cpu_path()
            self._told_cpu = True
        self._run_manager = self.manager if graphs_usable else self._eager_manager(trainer)
        self._run_manager.begin_run(expected_calls, later_runs)
        tower, manager = self._tower, self._run_manager
        self._swapped = True
        tower.forward = graphed_forward_for(tower, manager.encoder, partial(execute, manager))

    def _agree_graphs_usable(self, trainer: pl.Trainer) -> bool:
        """Whether every rank can use graphs this run; if not, all run mode ``none``."""
        # A capture error turned a manager's paths eager; every later run agrees on it.
        self._capture_failed |= self.manager is not None and self.manager.capture_error is not None
        usable = self.manager is not None and not self._capture_failed
        agreed = trainer.strategy.reduce_boolean_decision(usable, all=True)
        if not agreed and self.manager is not None and self.mode is not GraphMode.NONE:
            rank_zero_warn(
                "CUDAGraphCallback: graph capture failed on at least one rank; every rank "
                "runs the tower eagerly (mode 'none')."
            )
        return agreed

    def _eager_manager(self, trainer: pl.Trainer) -> EncoderGraphManager:
        if self.mode is GraphMode.NONE:
            return self.manager
        if self._eager is None:
            self._eager = self._build_manager(self._tower, trainer, mode=GraphMode.NONE)
        return self._eager

    def _executor(
        self, trainer: pl.Trainer, stage: str
    ) -> Callable[[EncoderGraphManager, Any], Any]:
        """``manager.execute``, or its data-parallel form over the default process group."""
        if not self._data_parallel(trainer):
            return EncoderGraphManager.execute
        check_batches_not_sharded(trainer, stage)
        device = trainer.strategy.root_device
        return lambda manager, inputs: execute_data_parallel(manager, inputs, device=device)

    def _data_parallel(self, trainer: pl.Trainer) -> bool:
        """Whether ranks share out each batch's items (encoder_data_parallel, several ranks)."""
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        return self.encoder_data_parallel and distributed and trainer.world_size > 1

    def restore(self) -> None:
        """Put the tower's original forward back (safe to call at any time)."""
        if not self._swapped or self._tower is None:
            return
        del self._tower.forward  # the class's forward again: a tower with its own is left alone
        self._swapped = False

    def _bind_tensors(self) -> None:
        """Keep the graphs reading the tower's current values (see ``engine.binding``)."""
        if self._binding is None:
            cleared, self._cleared_layouts = self._cleared_layouts, None
            if cleared is not None and cleared != tensor_layouts(self._tower):
                self.manager.clear()  # new shapes or dtypes: what the old graphs measured goes
            self._binding = TensorBinding(self._tower)
            return
        outcome = self._binding.rebind(self._tower)
        if self.manager.is_captured():  # without graphs, new storage is nothing to tell
            report_rebinding(outcome)
        if outcome == CHANGED:
            self.manager.clear()
            self._binding = TensorBinding(self._tower)

    def _finish_run(self, trainer: pl.Trainer, stage: str) -> None:
        if not self._swapped:
            return
        self.restore()
        self._capture_failed |= self._run_manager.capture_error is not None
        self.last_stats = reduce_stats(trainer, self._run_manager.stats.as_dict())
        on_cuda = next(self._tower.parameters(), torch.empty(0)).is_cuda
        report_run(trainer, self.last_stats, stage, on_cuda)
        report_costly_captures(self._run_manager.costly_captures(), stage, self.module)
        if trainer.is_global_zero:
            self.manager.write_plan()
        if not self.keep_graphs:
            # Timings kept for graphs of the same tower; _bind_tensors forgets them otherwise.
            self.manager.clear(keep_timings=True)
            self._binding = None
            self._cleared_layouts = tensor_layouts(self._tower)

    @property
    @override
    def state_key(self) -> str:
        # One callback per tower: a named tower tells two callbacks' states apart.
        if self._find_tower:
            return super().state_key
        return self._generate_state_key(module=self.module)

    @override
    def state_dict(self) -> dict[str, Any]:
        """What the capture rule learned (``EncoderGraphManager.state_dict``); Lightning
        saves it in every checkpoint. Empty before any manager, unless one was loaded."""
        state = self.manager.state_dict() if self.manager is not None else self._loaded_state
        return {} if state is None else {"manager": state}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved, into the manager, or the next one built
        (at a run's start). A state of another tower or device is ignored with a warning."""
        state = state_dict.get("manager")
        if state is None:
            return
        if self.manager is not None:
            self.manager.load_state_dict(state, "the checkpoint")
        else:
            self._loaded_state = state
