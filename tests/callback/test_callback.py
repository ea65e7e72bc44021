import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import Logger
from lightning.pytorch.strategies import FSDPStrategy

from examples.data.synthetic import SyntheticDataModule
from examples.models.lit import VisionClassifier, build_tower
from examples.models.packed_vit import PackedViT
from lightning_cg.callback.graph_callback import CUDAGraphCallback
from lightning_cg.engine.manager import EncoderGraphManager

TINY = dict(hidden_size=32, depth=1, num_heads=2, patch_size=4, out_hidden_size=16)
BUDGETS = {"min_budget": 8, "max_budget": 256}


class RecordingModel(VisionClassifier):
    """Records whether each training step saw the tower's own forward."""

    def __init__(self) -> None:
        super().__init__(build_tower("packed_vit_small", **TINY), num_classes=4)
        self.training_forwards: list[bool] = []

    def training_step(self, batch, batch_idx):
        self.training_forwards.append("forward" not in self.vision_tower.__dict__)
        return super().training_step(batch, batch_idx)


def datamodule(num_items: int = 12) -> SyntheticDataModule:
    return SyntheticDataModule(
        num_items=num_items, batch_size=4, min_side=8, max_side=40, patch_size=4, num_classes=4
    )


def trainer(*callbacks, **kwargs) -> Trainer:
    options = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return Trainer(callbacks=list(callbacks), **{**options, **kwargs})


def model() -> RecordingModel:
    torch.manual_seed(0)
    return RecordingModel()


def predictions(callback=None, **trainer_kwargs) -> torch.Tensor:
    callbacks = [callback] if callback else []
    return torch.cat(trainer(*callbacks, **trainer_kwargs).predict(model(), datamodule()))


def test_predict_equals_eager_and_restores_forward():
    callback = CUDAGraphCallback(budgets=BUDGETS, capture="first_use")
    graphed = predictions(callback)
    eager = predictions()
    torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-6)
    assert "forward" not in callback._tower.__dict__
    assert callback.last_stats["hits"] > 0 and callback.last_stats["items"] == 12


@pytest.mark.parametrize("inference_mode", [True, False])
def test_validate_swaps_in_and_out(inference_mode):
    callback = CUDAGraphCallback(budgets=BUDGETS, capture="first_use")
    net = model()
    results = trainer(callback, inference_mode=inference_mode).validate(
        net, datamodule(), verbose=False
    )
    eager = trainer(inference_mode=inference_mode).validate(net, datamodule(), verbose=False)
    assert results[0]["val_loss"] == pytest.approx(eager[0]["val_loss"], rel=1e-5)
    assert "forward" not in net.vision_tower.__dict__
    assert callback.last_stats["hits"] > 0


def test_fit_trains_eagerly_and_matches_a_fit_without_the_callback():
    nets = []
    for callbacks in ([CUDAGraphCallback(budgets=BUDGETS, capture="first_use")], []):
        net = model()
        trainer(*callbacks, max_epochs=2, deterministic=True).fit(net, datamodule())
        nets.append(net)
    graphed, plain = nets
    assert graphed.training_forwards and all(graphed.training_forwards)
    for (name, a), (_, b) in zip(
        graphed.state_dict().items(), plain.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def captured(callback: CUDAGraphCallback) -> dict:
    return dict(callback.manager.cache.items())


def eager_predictions(net: RecordingModel) -> torch.Tensor:
    return torch.cat(trainer().predict(net, datamodule()))


def test_graphs_outlive_runs_and_new_weights_are_served_without_recapture():
    callback = CUDAGraphCallback(budgets=BUDGETS, capture="first_use")
    net = model()
    run = trainer(callback, max_epochs=2)
    run.fit(net, datamodule())
    graphs = captured(callback)
    assert graphs
    eager_val = trainer().validate(net, datamodule(), verbose=False)[0]["val_loss"]
    assert run.validate(net, datamodule(), verbose=False)[0]["val_loss"] == pytest.approx(
        eager_val, rel=1e-5
    )
    torch.testing.assert_close(torch.cat(run.predict(net, datamodule())), eager_predictions(net))
    # Other weights in new storage (not in place), as a checkpoint load with assign=True.
    other = model()
    with torch.no_grad():
        for parameter in other.vision_tower.parameters():
            parameter.mul_(1.5)
    net.vision_tower.load_state_dict(other.vision_tower.state_dict(), assign=True)
    expected = eager_predictions(other)
    torch.testing.assert_close(torch.cat(run.predict(net, datamodule())), expected)
    assert captured(callback) == graphs  # the same graph objects: nothing recaptured
    assert callback.last_stats["graphs_captured"] == 0 and callback.last_stats["hits"] > 0


@pytest.mark.parametrize("mode", ["full", "none"])
def test_new_storage_is_reported_only_while_graphs_read_the_old(mode, caplog):
    callback = CUDAGraphCallback(mode=mode, budgets=BUDGETS, capture="first_use")
    net = model()
    trainer(callback).predict(net, datamodule())
    # Weights in new storage, as a checkpoint load with assign=True.
    net.vision_tower.load_state_dict(model().vision_tower.state_dict(), assign=True)
    with caplog.at_level("INFO"):
        trainer(callback).predict(net, datamodule())
    told = "came back in new storage" in caplog.text
    assert told == (mode == "full")


def test_a_dtype_change_recaptures():
    callback = CUDAGraphCallback(budgets=BUDGETS, capture="first_use")
    net = model()
    trainer(callback).predict(net, datamodule())
    graphs = captured(callback)
    doubled = torch.cat(trainer(callback, precision="64-true").predict(net, datamodule()))
    assert doubled.dtype == torch.float64
    old = {id(graph) for graph in graphs.values()}
    assert captured(callback) and not old & {id(graph) for graph in captured(callback).values()}


def test_exception_in_predict_restores_forward():
    class Exploding(RecordingModel):
        def predict_step(self, batch, batch_idx, dataloader_idx=0):
            self.vision_tower(batch["pixel_patches"], batch["grid_thw"])
            raise RuntimeError("boom")

    net = Exploding()
    callback = CUDAGraphCallback(budgets=BUDGETS, capture="first_use")
    with pytest.raises(RuntimeError, match="boom"):
        trainer(callback).predict(net, datamodule())
    assert "forward" not in net.vision_tower.__dict__


def test_two_callbacks_on_one_tower_are_refused_and_leave_the_forward_alone():
    net = model()
    first = CUDAGraphCallback(budgets=BUDGETS, capture="first_use")
    second = CUDAGraphCallback(module="vision_tower", stages=["predict"], mode="full_uniform_only")
    with pytest.raises(ValueError) as refused:
        trainer(first, second).predict(net, datamodule())
    message = str(refused.value)
    assert "two CUDAGraphCallbacks serve the same tower PackedViT" in message
    assert "stages=['validate', 'test', 'predict'], mode='full'" in message
    assert "stages=['predict'], mode='full_uniform_only'" in message
    assert "forward" not in net.vision_tower.__dict__
    assert first.manager is None and second.manager is None
    trainer(max_epochs=1, limit_val_batches=1).fit(net, datamodule())
    assert net.training_forwards and all(net.training_forwards)
    assert "forward" not in net.vision_tower.__dict__


def test_a_tower_whose_forward_another_wrapper_set_is_left_alone_with_a_warning():
    net = model()
    class_forward = type(net.vision_tower).forward

    def doubled(*args, **kwargs):  # another library's wrapper, set on the instance
        return 2 * class_forward(net.vision_tower, *args, **kwargs)

    net.vision_tower.forward = doubled
    callback = CUDAGraphCallback(budgets=BUDGETS, capture="first_use")
    with pytest.warns(UserWarning, match="forward is set on the instance.*leaving it alone"):
        served = torch.cat(trainer(callback).predict(net, datamodule()))
    assert net.vision_tower.__dict__["forward"] is doubled
    # The wrapper served every call: the outputs are the wrapper's, not the class's.
    expected = torch.cat(trainer().predict(net, datamodule()))
    torch.testing.assert_close(served, expected, rtol=0, atol=0)


def test_keep_graphs_false_frees_graphs_after_each_run():
    callback = CUDAGraphCallback(budgets=BUDGETS, keep_graphs=False, capture="first_use")
    trainer(callback).predict(model(), datamodule())
    assert not callback.manager.is_captured()


def test_keep_graphs_false_keeps_timings_until_the_tower_changes(monkeypatch):
    # Freed graphs come back the same (a graph measured slower stays eager), unless the
    # tower's tensors changed shape, dtype or number by the next run.
    kept = []
    clear = EncoderGraphManager.clear

    def recording_clear(self, keep_timings=False):
        kept.append(keep_timings)
        clear(self, keep_timings)

    monkeypatch.setattr(EncoderGraphManager, "clear", recording_clear)
    callback = CUDAGraphCallback(budgets=BUDGETS, keep_graphs=False, capture="first_use")
    net, data = model(), datamodule()
    trainer(callback).predict(net, data)
    trainer(callback).predict(net, data)
    assert kept == [True, True]
    net.vision_tower.register_buffer("scale", torch.ones(1))
    trainer(callback).predict(net, data)
    assert kept == [True, True, False, True]


def test_stages_limit_where_graphs_run():
    callback = CUDAGraphCallback(budgets=BUDGETS, stages=["validate"], capture="first_use")
    trainer(callback).predict(model(), datamodule())
    # No stage of this run is configured: no tower looked up, no manager built.
    assert callback.manager is None and callback.last_stats == {}


def test_bf16_mixed_matches_eager_within_bf16_tolerance():
    graphed = predictions(
        CUDAGraphCallback(budgets=BUDGETS, capture="first_use"), precision="bf16-mixed"
    )
    eager = predictions(precision="bf16-mixed")
    assert ((graphed - eager).norm() / eager.norm()).item() < 2e-2


class MetricsLogger(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.metrics: dict[str, float] = {}

    name = "memory"
    version = 0

    def log_metrics(self, metrics, step=None):
        self.metrics.update(metrics)

    def log_hyperparams(self, params, *args, **kwargs):
        pass


@pytest.mark.parametrize("stage", ["validate", "predict"])
def test_stats_reach_the_loggers(stage):
    memory = MetricsLogger()
    run = trainer(CUDAGraphCallback(budgets=BUDGETS, capture="first_use"), logger=memory)
    getattr(run, stage)(model(), datamodule())
    assert memory.metrics["cudagraph/items"] == 12
    assert memory.metrics["cudagraph/hits"] >= 1
    assert 0 < memory.metrics["cudagraph/hit_rate"] <= 1


def test_compiled_tower_is_left_alone_with_a_warning():
    net = model()
    net.vision_tower = torch.compile(net.vision_tower, backend="eager")
    compiled_forward = net.vision_tower.forward
    callback = CUDAGraphCallback(budgets=BUDGETS, capture="first_use")
    with pytest.warns(UserWarning, match="torch.compile"):
        trainer(callback).predict(net, datamodule(4))
    assert callback.manager is None and callback.last_stats == {}
    assert net.vision_tower.forward == compiled_forward


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"mode": "fastest"}, "mode"),
        ({"budgets": {"min_budget": 0}}, "min_budget"),
        ({"budgets": {"min_budget": 64, "max_budget": 8}}, "min_budget"),
        ({"budgets": {"budgets": [0, 8]}}, "budgets"),
        ({"budgets": {"ladder": "fibonacci"}}, "ladder"),
        ({"budgets": {"max": 8}}, "budgets"),
        ({"paths": {"local": {"steps": 3}}}, "paths.local"),
        ({"stages": ["fit"]}, "stages"),
        ({"max_items_per_batch": 0}, "max_items_per_batch"),
        ({"module": "vision tower"}, "module"),
        ({"adapter": "magic"}, "adapter"),
        ({"adapter": torch.nn.Linear(2, 2)}, "got adapter=a Linear module$"),
        ({"stages": "validate"}, "stages must be a non-empty list"),
        ({"keep_graphs": "no"}, "keep_graphs must be true or false"),
        ({"cast_weights_per_run": "no"}, "cast_weights_per_run must be true, false or null"),
        ({"capture": "always"}, "capture must be one of paid_back, first_use"),
        ({"budgets": {"budgets": [64.9, 128]}}, "budgets"),
        ({"budgets": "pow2"}, "budgets must be a mapping"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, field):
    with pytest.raises(ValueError, match=field):
        CUDAGraphCallback(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"module": "visual"}, "module='visual'"),
        ({"module": "hparams"}, "not a torch.nn.Module"),
        ({"module": "head"}, "no adapter fits"),
        ({"budgets": {"budgets": [8, 16]}, "max_items_per_batch": 32}, "max_items"),
        ({"paths": {"elsewhere": {"budgets": [8]}}}, r"paths names unknown .*'elsewhere'"),
    ],
)
def test_bad_towers_and_budgets_fail_before_the_first_batch(kwargs, field):
    callback = CUDAGraphCallback(**kwargs, capture="first_use")
    net = model()
    steps = []
    net.predict_step = lambda batch, batch_idx: steps.append(batch_idx)
    with pytest.raises(ValueError, match=field):
        trainer(callback).predict(net, datamodule())
    assert steps == [] and callback.manager is None


def test_sharding_strategies_are_refused():
    class FakeTrainer:
        strategy = FSDPStrategy()

    with pytest.raises(RuntimeError, match="FSDPStrategy"):
        CUDAGraphCallback(capture="first_use").setup(FakeTrainer(), model(), "fit")


def test_a_tower_implementing_the_protocol_is_used_as_is():
    from toy_encoder import ToyEncoder, ToyTower

    from lightning_cg.adapters import adapter_for

    encoder = ToyEncoder(ToyTower())
    assert adapter_for(encoder) is encoder
    assert (
        type(adapter_for(PackedViT(build_tower("packed_vit_small", **TINY).config))).__name__
        == "PackedEncoderAdapter"
    )


def test_hydra_target_builds_the_callback():
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from test_app import CONF

    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose(
            "predict", overrides=["cudagraph=full_uniform_only", "cudagraph.budgets.max_budget=512"]
        )
    callback = instantiate(cfg.cudagraph)
    assert isinstance(callback, CUDAGraphCallback)
    assert callback.mode.name == "FULL_UNIFORM_ONLY" and callback.config.budgets.max_budget == 512
