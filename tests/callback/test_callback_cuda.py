"""The callback in a real Trainer on a CUDA GPU: predictions against eager, graph reuse."""

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from test_callback import trainer as quiet_trainer

from examples.data.synthetic import FakeDataModule, SyntheticDataModule
from examples.models.lit import VisionClassifier, build_tower
from lightning_cg.callback.graph_callback import CUDAGraphCallback

pytestmark = pytest.mark.cuda

PACKED = dict(hidden_size=64, depth=2, num_heads=4, patch_size=4, out_hidden_size=32)
VIT = dict(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64)
MODES = ["full", "full_uniform_only", "none"]


def model(kind: str) -> VisionClassifier:
    torch.manual_seed(0)
    tower = (
        build_tower("packed_vit_small", **PACKED)
        if kind == "packed"
        else build_tower("vit_b_16", **VIT)
    )
    return VisionClassifier(tower, num_classes=4)


def datamodule(kind: str, uniform: bool = False):
    if kind == "packed":
        return SyntheticDataModule(
            num_items=12,
            batch_size=4,
            min_side=32 if uniform else 8,
            max_side=32 if uniform else 48,
            patch_size=4,
            num_classes=4,
        )
    return FakeDataModule(num_items=12, batch_size=4, image_size=32, num_classes=4)


def trainer(*callbacks, **kwargs) -> Trainer:
    """The CPU tests' quiet Trainer, on one GPU."""
    return quiet_trainer(*callbacks, **{"accelerator": "gpu", "devices": 1, **kwargs})


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(autouse=True)
def no_tf32(monkeypatch):
    # TF32 kernels differ between batch sizes; fp32 parity is checked without them.
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


@pytest.mark.parametrize("kind", ["packed", "vit"])
@pytest.mark.parametrize("mode", MODES)
def test_predict_equals_eager_for_each_model_and_mode(kind, mode):
    callback = CUDAGraphCallback(
        mode=mode, budgets={"max_budget": 256} if kind == "packed" else None, capture="first_use"
    )
    net = model(kind)
    # full_uniform_only graphs only batches of one image size.
    uniform = mode == "full_uniform_only"
    graphed = torch.cat(trainer(callback).predict(net, datamodule(kind, uniform)))
    eager = torch.cat(trainer().predict(net, datamodule(kind, uniform)))
    assert eager.abs().max() > 0
    assert relative_error(graphed, eager) < 1e-5
    if mode != "none":
        assert callback.last_stats["graphs"] > 0 and callback.last_stats["hits"] > 0
    assert "forward" not in net.vision_tower.__dict__


@pytest.mark.parametrize("inference_mode", [True, False])
def test_bf16_mixed_and_inference_mode(inference_mode):
    callback = CUDAGraphCallback(budgets={"max_budget": 256}, capture="first_use")
    net = model("packed")
    run = dict(precision="bf16-mixed", inference_mode=inference_mode)
    graphed = torch.cat(trainer(callback, **run).predict(net, datamodule("packed")))
    eager = torch.cat(trainer(**run).predict(net, datamodule("packed")))
    assert relative_error(graphed, eager) < 2e-2
    assert callback.last_stats["hits"] > 0


def test_graphs_are_captured_once_per_fit_and_kept_after_the_tower_moves():
    callback = CUDAGraphCallback(budgets={"max_budget": 256}, capture="first_use")
    graphs_after_each_validation = []

    class Record(Callback):
        def on_validation_end(self, trainer, pl_module):
            graphs_after_each_validation.append(dict(callback.manager.cache.items()))

    net = model("packed")
    fit = trainer(callback, Record(), max_epochs=2)
    fit.fit(net, datamodule("packed"))
    first, second = graphs_after_each_validation
    assert first and all(g.cuda_graph is not None for g in first.values())
    assert second.keys() == first.keys()
    assert all(second[key] is graph for key, graph in first.items())
    # Lightning moves the module to the CPU when fit ends; validate brings it
    # back at new addresses, whose values are copied into the graphs' storage.
    graphed = fit.validate(net, datamodule("packed"), verbose=False)[0]["val_loss"]
    third = graphs_after_each_validation[-1]
    assert all(third[key] is graph for key, graph in first.items())
    assert callback.last_stats["graphs_captured"] == 0
    eager = trainer().validate(net, datamodule("packed"), verbose=False)[0]["val_loss"]
    assert graphed == pytest.approx(eager, rel=1e-4)


def test_a_second_predict_captures_nothing_and_serves_new_weights():
    callback = CUDAGraphCallback(budgets={"max_budget": 256}, capture="first_use")
    net = model("packed")
    run = trainer(callback)
    captured = []
    for weights in ("first", "same", "other"):
        if weights == "other":  # new weights in new storage, as a checkpoint load
            other = model("packed")
            with torch.no_grad():
                for parameter in other.vision_tower.parameters():
                    parameter.add_(torch.randn_like(parameter) * 0.1)
            net.vision_tower.load_state_dict(other.vision_tower.state_dict(), assign=True)
        graphed = torch.cat(run.predict(net, datamodule("packed")))
        captured.append(callback.last_stats["graphs_captured"])
        assert callback.last_stats["hits"] > 0
        eager = torch.cat(trainer().predict(net, datamodule("packed")))
        assert relative_error(graphed, eager) < 1e-5
    assert captured[0] > 0 and captured[1:] == [0, 0]


def test_a_fit_then_a_test_run_reuses_the_validation_graphs():
    callback = CUDAGraphCallback(budgets={"max_budget": 256}, capture="first_use")
    net = model("packed")
    run = trainer(callback, max_epochs=1)
    run.fit(net, datamodule("packed"))
    graphs = dict(callback.manager.cache.items())
    assert graphs
    graphed = run.test(net, datamodule("packed"), verbose=False)[0]["test_loss"]
    assert callback.last_stats["hits"] > 0 and callback.last_stats["graphs_captured"] == 0
    after = dict(callback.manager.cache.items())
    assert all(after[key] is graph for key, graph in graphs.items())
    eager = trainer().test(net, datamodule("packed"), verbose=False)[0]["test_loss"]
    assert graphed == pytest.approx(eager, rel=1e-4)


def test_graphs_captured_counts_this_runs_captures_after_an_earlier_run_captured():
    callback = CUDAGraphCallback(budgets={"max_budget": 256}, capture="first_use")
    net = model("packed")
    run = trainer(callback)
    run.predict(net, datamodule("packed", uniform=True))
    first = callback.last_stats["graphs_captured"]
    graphs_after_first = callback.last_stats["graphs"]
    run.predict(net, datamodule("packed"))  # mixed sizes: keys the first run never saw
    second = callback.last_stats["graphs_captured"]
    assert first > 0 and second > 0
    assert second == callback.last_stats["graphs"] - graphs_after_first


#: Wide enough that bf16 copies of its weights (25 MiB) would show in training's peak.
WIDE_VIT = dict(
    image_size=32, patch_size=8, num_layers=4, num_heads=8, hidden_dim=512, mlp_dim=2048
)


class TrainingPeaks(Callback):
    """Peak allocated device memory of each training step after the first validation."""

    def __init__(self) -> None:
        self.peaks: list[int] = []
        self.validated = False

    def on_validation_end(self, trainer, pl_module):
        self.validated = True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        torch.cuda.reset_peak_memory_stats()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.validated:
            self.peaks.append(torch.cuda.max_memory_allocated())


def training_peak(*callbacks) -> int:
    torch.manual_seed(0)
    net = VisionClassifier(build_tower("vit_b_16", **WIDE_VIT), num_classes=4)
    peaks = TrainingPeaks()
    data = FakeDataModule(num_items=32, batch_size=8, image_size=32, num_classes=4)
    trainer(*callbacks, peaks, max_epochs=3, precision="bf16-mixed").fit(net, data)
    return max(peaks.peaks)


def test_held_graphs_leave_a_fits_training_memory_as_without_them():
    # Without the callback first: what a run leaves allocated would count in the next.
    without = training_peak()
    callback = CUDAGraphCallback(capture="first_use")  # cast_weights_per_run: its default
    with_graphs = training_peak(callback)
    assert callback.manager.is_captured() and callback.last_stats["hits"] > 0
    assert with_graphs - without <= max(0.01 * without, 16 * 2**20)
