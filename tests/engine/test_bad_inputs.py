"""Inputs a tower does not expect: a clear error or a correct run, never a silent wrong replay.

Wrong dtype, wrong device, non-contiguous tensors, and a packed batch whose
``grid_thw`` disagrees with its patches, through the manager and the adapters.
"""

import dataclasses
import random

import pytest
import torch
from packed_calls import packed_call, packed_tower, tiny_vit
from test_callback import BUDGETS, RecordingModel, datamodule, trainer
from toy_encoder import ToyEncoder, ToyTower

from examples.models.lit import build_tower
from examples.models.packed_vit import PackedViT
from lightning_cg.adapters.batched import BatchedEncoderAdapter
from lightning_cg.adapters.packed import PackedEncoderAdapter
from lightning_cg.callback.graph_callback import CUDAGraphCallback
from lightning_cg.engine import budget_memory
from lightning_cg.engine.encoder import CaptureSpec
from lightning_cg.engine.manager import BudgetConfig, EncoderGraphManager
from lightning_cg.engine.replay import relative_error


def packed_manager(device: str = "cpu") -> tuple[PackedViT, EncoderGraphManager]:
    tower = packed_tower(global_view=True, device=device)
    adapter = PackedEncoderAdapter(tower, min_token_budget=4, max_token_budget=64)
    return tower, EncoderGraphManager(adapter, mode="full", capture="first_use")


def vit_manager(device: str = "cpu") -> tuple[torch.nn.Module, EncoderGraphManager]:
    tower = tiny_vit(device)
    return tower, EncoderGraphManager(
        BatchedEncoderAdapter(tower, max_batch_size=8), mode="full", capture="first_use"
    )


def execute(manager: EncoderGraphManager, *call) -> torch.Tensor:
    with torch.no_grad():
        return manager.execute(manager.encoder.inputs_from_call(call, {}))


def graph_dtypes(manager: EncoderGraphManager, buffer: str) -> set[torch.dtype]:
    return {graph.buffers[buffer].dtype for graph in manager.cache.graphs()}


# ------------------------------------------------------------------- dtype


def test_a_float64_batch_after_float32_graphs_gets_graphs_of_its_own():
    tower, manager = packed_manager()
    rng = random.Random(0)
    for dtype in (torch.float32, torch.float64, torch.float32):
        patches, grid_thw = packed_call(rng, 3, dtype=dtype)
        actual = execute(manager, patches, grid_thw)
        with torch.no_grad():
            expected = tower(patches, grid_thw)  # the tower casts to its weights' dtype
        assert actual.dtype == expected.dtype
        assert relative_error(actual, expected) < 1e-5
    assert graph_dtypes(manager, "pixel_patches") == {torch.float32, torch.float64}
    assert len({key.graph_set for key in manager.cache.keys()}) == 2  # two graph sets
    assert manager.stats.hits == 6 and manager.stats.misses == 0


def test_a_float64_batch_to_a_float32_batch_first_tower_fails_as_it_does_eagerly():
    tower, manager = vit_manager()
    x = torch.randn(3, 3, 32, 32)
    assert relative_error(execute(manager, x), tower(x)) < 1e-5
    float32_graphs = dict(manager.cache.items())
    with torch.no_grad(), pytest.raises(RuntimeError) as eager:
        tower(x.double())
    with pytest.raises(type(eager.value), match="type"):
        execute(manager, x.double())
    # The float32 graphs are untouched and still serve float32 batches.
    assert all(manager.cache.get(key) is graph for key, graph in float32_graphs.items())
    assert relative_error(execute(manager, x), tower(x)) < 1e-5
    assert (manager.stats.hits, manager.stats.misses) == (2, 0)  # the failed replay is none


class DtypeBlindEncoder(ToyEncoder):
    """A signature without the dtype: float32 and float64 batches share graphs."""

    def graph_signature(self, inputs):
        return inputs.tokens.device

    def capture_inputs(self, spec):
        return super().capture_inputs(
            dataclasses.replace(spec, signature=(torch.float32, spec.signature))
        )


def test_a_dtype_the_graphs_were_not_captured_for_is_never_cast_silently():
    manager = EncoderGraphManager(DtypeBlindEncoder(ToyTower().eval()), capture="first_use")
    lengths = torch.tensor([5, 7])
    execute(manager, torch.randn(12, 8), lengths)
    with pytest.raises(RuntimeError, match="graph signature should have separated them"):
        execute(manager, torch.randn(12, 8, dtype=torch.float64), lengths)


# ------------------------------------------------------------------ device


def test_a_batch_on_another_device_than_the_packed_tower_is_refused():
    tower = packed_tower().to("meta")  # stands in for a CUDA tower on a CPU-only machine
    adapter = PackedEncoderAdapter(tower)
    patches, grid_thw = packed_call(random.Random(1), 2)
    with pytest.raises(ValueError, match="pixel_patches is on cpu, the tower on meta"):
        adapter.inputs_from_call((patches, grid_thw), {})


@pytest.mark.cuda
def test_cuda_a_cpu_batch_to_a_cuda_packed_tower_is_refused():
    tower, manager = packed_manager("cuda")
    patches, grid_thw = packed_call(random.Random(2), 3)
    with pytest.raises(ValueError, match="pixel_patches is on cpu, the tower on cuda"):
        execute(manager, patches, grid_thw)
    actual = execute(manager, patches.cuda(), grid_thw)
    with torch.no_grad():
        assert relative_error(actual, tower(patches.cuda(), grid_thw)) < 1e-5
    assert manager.stats.hits > 0 and all(g.cuda_graph for g in manager.cache.graphs())


@pytest.mark.cuda
def test_cuda_a_cpu_batch_to_a_cuda_batch_first_tower_fails_as_it_does_eagerly(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    tower, manager = vit_manager("cuda")
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad(), pytest.raises(RuntimeError) as eager:
        tower(x)
    with pytest.raises(type(eager.value)):
        execute(manager, x)
    assert not any(graph.cuda_graph for graph in manager.cache.graphs())
    with torch.no_grad():
        assert relative_error(execute(manager, x.cuda()), tower(x.cuda())) < 1e-5
    assert manager.stats.hits == 1
    assert sum(graph.cuda_graph is not None for graph in manager.cache.graphs()) > 0


# ------------------------------------------------------------ non-contiguous


def non_contiguous(shape: tuple[int, ...], layout: str, dtype=torch.float32) -> torch.Tensor:
    """A tensor of ``shape`` whose memory is not row-major."""
    if layout == "transposed":
        x = torch.randn(*reversed(shape), dtype=dtype).permute(*reversed(range(len(shape))))
    else:  # every other element of a wider tensor
        x = torch.randn(*shape[:-1], 2 * shape[-1], dtype=dtype)[..., ::2]
    assert x.shape == shape and not x.is_contiguous()
    return x


@pytest.mark.parametrize("layout", ["transposed", "strided"])
def test_a_non_contiguous_toy_batch_replays_as_eager(layout):
    tower = ToyTower(global_tokens=4).eval()
    manager = EncoderGraphManager(
        ToyEncoder(tower), budgets=BudgetConfig(budgets=[16, 64]), capture="first_use"
    )
    lengths = torch.tensor([5, 7, 3])
    tokens = non_contiguous((15, 8), layout)
    with torch.no_grad():
        expected = tower(tokens.contiguous(), lengths)
    assert relative_error(execute(manager, tokens, lengths), expected) < 1e-5
    assert manager.stats.hits == 2


@pytest.mark.parametrize("layout", ["transposed", "strided"])
def test_a_non_contiguous_packed_batch_replays_as_eager(layout):
    tower, manager = packed_manager()
    patches, grid_thw = packed_call(random.Random(3), 4)
    strided = non_contiguous(tuple(patches.shape), layout)
    strided.copy_(patches)
    actual = execute(manager, strided, grid_thw)
    with torch.no_grad():
        assert relative_error(actual, tower(patches, grid_thw)) < 1e-5
    assert manager.stats.hits == 2  # local and global


@pytest.mark.parametrize("layout", ["transposed", "strided"])
def test_a_non_contiguous_batch_first_batch_replays_as_eager(layout):
    tower, manager = vit_manager()
    x = non_contiguous((3, 3, 32, 32), layout)
    with torch.no_grad():
        expected = tower(x.contiguous())
    assert relative_error(execute(manager, x), expected) < 1e-5
    assert manager.stats.hits == 1


# ---------------------------------------------------------------- grid_thw


@pytest.mark.parametrize("wrong", ["item_dropped", "rows_doubled"])
def test_a_grid_thw_that_disagrees_with_the_patches_is_refused(wrong):
    _, manager = packed_manager()
    patches, grid_thw = packed_call(random.Random(4), 3)
    grid_thw = grid_thw[:-1] if wrong == "item_dropped" else grid_thw * torch.tensor([1, 2, 1])
    with pytest.raises(ValueError, match="grid_thw disagrees with pixel_patches"):
        execute(manager, patches, grid_thw)
    assert manager.stats.items == 0 and not manager.is_captured()


def test_the_callback_passes_a_grid_thw_error_through_and_restores_the_forward():
    class WrongGrid(RecordingModel):
        def predict_step(self, batch, batch_idx, dataloader_idx=0):
            return self.vision_tower(batch["pixel_patches"], batch["grid_thw"][:-1])

    torch.manual_seed(0)
    net = WrongGrid()
    with pytest.raises(ValueError, match="grid_thw disagrees with pixel_patches"):
        trainer(CUDAGraphCallback(budgets=BUDGETS, capture="first_use")).predict(net, datamodule())
    assert "forward" not in net.vision_tower.__dict__


# ------------------------------------------------------- sizes and non-finite


def test_a_batch_first_budget_beyond_memory_is_refused_where_the_tower_fixes_its_side():
    tower = tiny_vit("cpu")  # 32 px: 6 KiB an image at 2 bytes a value
    host = budget_memory.host_memory_bytes()
    too_many = host // (3 * 32 * 32 * 2) + 1
    with pytest.raises(ValueError, match=rf"max_budget={too_many} cannot fit.*host memory"):
        EncoderGraphManager(BatchedEncoderAdapter(tower), budgets={"max_budget": too_many})
    fits = EncoderGraphManager(BatchedEncoderAdapter(tower), budgets={"max_budget": 4096})
    assert max(fits.paths["image"].budgets) == 4096
    # A ResNet takes any side: its input rows are only known from the first batch.
    resnet = build_tower("resnet18", num_classes=8)
    EncoderGraphManager(BatchedEncoderAdapter(resnet), budgets={"max_budget": too_many})


def test_the_packed_bound_is_at_most_the_static_patch_rows_of_a_budget():
    _, manager = packed_manager()
    spec = CaptureSpec("local", 64, 4, 4, (torch.bfloat16, torch.device("cpu")))
    buffers = manager.encoder.capture_inputs(spec)
    assert manager.encoder.min_bytes_per_token("local") * 64 == buffers["pixel_patches"].nbytes


@pytest.mark.cuda
def test_cuda_a_budget_beyond_the_gpu_is_refused_naming_the_device():
    tower, _ = packed_manager("cuda")
    adapter = PackedEncoderAdapter(tower, min_token_budget=4, max_token_budget=64)
    total = torch.cuda.get_device_properties(0).total_memory
    too_many = total // adapter.min_bytes_per_token("local") + 1
    with pytest.raises(ValueError, match=rf"max_budget={too_many} cannot fit.*of cuda:0"):
        EncoderGraphManager(adapter, budgets={"max_budget": too_many})


class NotBatchFirst(torch.nn.Module):
    """A tower whose output rows do not follow its batch rows."""

    def __init__(self, output: str) -> None:
        super().__init__()
        self.output = output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.output == "scalar":
            return x.sum()
        if self.output == "transposed":
            return x.t()
        return x[x[:, 0] > 0]  # as many rows as the data says


@pytest.mark.parametrize("capture", ["paid_back", "first_use"])
@pytest.mark.parametrize(
    ("output", "got"),
    [("scalar", "a 0-dim tensor"), ("transposed", "6 rows [6, 3]"), ("data_dependent", "rows")],
)
def test_a_tower_whose_rows_are_not_its_items_is_told_what_a_tower_must_return(
    output, got, capture
):
    # first_use: the first call replays a graph (the padded path on the CPU) before eager.
    tower = NotBatchFirst(output)
    manager = EncoderGraphManager(BatchedEncoderAdapter(tower), mode="full", capture=capture)
    x = torch.tensor([[1.0] * 6, [-1.0] * 6, [-1.0] * 6])
    with pytest.raises(RuntimeError) as error:
        execute(manager, x)
    message = str(error.value)
    assert got in message and "for 3 items whose item_specs promise 3 rows" in message
    assert "must return its items' rows along dim 0" in message
