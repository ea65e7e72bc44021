import pytest
import torch
from torch import nn
from torchvision.models import resnet18
from torchvision.models.vision_transformer import VisionTransformer

from lightning_cg.adapters.batched import IMAGE_PATH, BatchedEncoderAdapter
from lightning_cg.engine.encoder import CaptureSpec, GraphableEncoder
from lightning_cg.engine.manager import EncoderGraphManager


def tiny_vit(image_size: int = 16) -> nn.Module:
    vit = VisionTransformer(
        image_size=image_size,
        patch_size=8,
        num_layers=2,
        num_heads=2,
        hidden_dim=32,
        mlp_dim=64,
        num_classes=10,
    )
    # torchvision zeroes the head: every output would be 0, whatever the graph did.
    nn.init.normal_(vit.heads.head.weight)
    return vit.eval()


def tiny_resnet() -> nn.Module:
    return resnet18(num_classes=10).eval()


def replay_like_manager(adapter: BatchedEncoderAdapter, x: torch.Tensor, budget: int):
    """What the manager does for a FULL graph, without CUDA: prefix copy, zero pad, slice."""
    inputs = adapter.inputs_from_call((x,), {})
    spec = CaptureSpec(
        path=IMAGE_PATH,
        token_budget=budget,
        max_items=budget,
        max_frames=budget,
        signature=adapter.graph_signature(inputs),
    )
    buffers = adapter.capture_inputs(spec)
    for name, rows in adapter.replay_inputs(IMAGE_PATH, inputs).items():
        buffers[name][: rows.shape[0]].copy_(rows)
        buffers[name][rows.shape[0] :].zero_()
    tokens = sum(item.path_tokens[IMAGE_PATH] for item in adapter.item_specs(inputs))
    rows = adapter.graph_forward(IMAGE_PATH, buffers)[:tokens]
    per_item = [{IMAGE_PATH: row} for row in rows.split(1)]
    return adapter.postprocess(per_item, inputs)


@pytest.mark.parametrize("make_tower", [tiny_vit, tiny_resnet])
def test_padded_replay_matches_eager(make_tower):
    torch.manual_seed(0)
    adapter = BatchedEncoderAdapter(make_tower(), max_batch_size=8)
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        expected = adapter.eager_forward(IMAGE_PATH, x)
        replayed = replay_like_manager(adapter, x, budget=8)
    assert replayed.shape == (3, 10)
    torch.testing.assert_close(replayed, expected, rtol=1e-5, atol=1e-5)


def test_protocol_and_specs():
    adapter = BatchedEncoderAdapter(tiny_resnet(), max_batch_size=16)
    assert isinstance(adapter, GraphableEncoder)
    assert adapter.token_budget_range(IMAGE_PATH) == (1, 16)
    assert list(adapter.graph_config().paths) == [IMAGE_PATH]
    specs = adapter.item_specs(torch.zeros(4, 3, 8, 8))
    assert len(specs) == 4
    assert all(s.input_size == 1 and s.path_tokens == {IMAGE_PATH: 1} for s in specs)


def test_select_items_keeps_requested_order():
    adapter = BatchedEncoderAdapter(tiny_resnet())
    x = torch.arange(5.0).view(5, 1).expand(5, 3)
    torch.testing.assert_close(adapter.select_items(x, [3, 0, 4])[:, 0], torch.tensor([3.0, 0, 4]))


def test_select_items_of_consecutive_rows_is_a_view():
    adapter = BatchedEncoderAdapter(tiny_resnet())
    x = torch.arange(5.0).view(5, 1).expand(5, 3).contiguous()
    selected = adapter.select_items(x, [1, 2, 3])
    torch.testing.assert_close(selected[:, 0], torch.tensor([1.0, 2, 3]))
    assert selected.data_ptr() == x[1].data_ptr()


def test_signature_separates_image_sizes_and_dtypes():
    adapter = BatchedEncoderAdapter(tiny_resnet())
    small = adapter.graph_signature(torch.zeros(2, 3, 224, 224))
    assert small == adapter.graph_signature(torch.zeros(7, 3, 224, 224))
    assert small != adapter.graph_signature(torch.zeros(2, 3, 384, 384))
    assert small != adapter.graph_signature(torch.zeros(2, 3, 224, 224, dtype=torch.bfloat16))


def test_capture_inputs_follow_signature():
    adapter = BatchedEncoderAdapter(tiny_resnet())
    signature = adapter.graph_signature(torch.zeros(2, 3, 40, 48, dtype=torch.float64))
    spec = CaptureSpec(IMAGE_PATH, token_budget=5, max_items=5, max_frames=5, signature=signature)
    x = adapter.capture_inputs(spec)["x"]
    assert x.shape == (5, 3, 40, 48) and x.dtype == torch.float64


def test_keyword_call_uses_forward_parameter_name():
    adapter = BatchedEncoderAdapter(tiny_resnet())
    x = torch.zeros(2, 3, 16, 16)
    assert adapter.inputs_from_call((), {"x": x}) is x


class KeywordOnlyTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 4)

    def forward(self, *, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def test_a_keyword_only_tower_is_served_by_name():
    tower = KeywordOnlyTower()
    adapter, manager = manager_for(tower)
    x = torch.randn(5, 6)
    with torch.no_grad():
        out = manager.execute(adapter.inputs_from_call((), {"x": x}))
        torch.testing.assert_close(out, tower(x=x), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((), {}),
        ((torch.zeros(1, 3, 8, 8), torch.zeros(1)), {}),
        ((torch.zeros(1, 3, 8, 8),), {"mask": torch.zeros(1)}),
        ((), {"images": torch.zeros(1, 3, 8, 8)}),
        (([torch.zeros(3, 8, 8)],), {}),
    ],
)
def test_bad_calling_conventions_raise(args, kwargs):
    adapter = BatchedEncoderAdapter(tiny_resnet())
    with pytest.raises(ValueError, match="GraphableEncoder"):
        adapter.inputs_from_call(args, kwargs)


def test_uses_original_forward_after_instance_forward_is_swapped():
    tower = tiny_resnet()
    adapter = BatchedEncoderAdapter(tower)
    tower.forward = lambda x: pytest.fail("the adapter called the swapped forward")
    with torch.no_grad():
        assert adapter.eager_forward(IMAGE_PATH, torch.randn(2, 3, 16, 16)).shape == (2, 10)


class TupleTower(nn.Module):
    def forward(self, x):
        return x, x


def test_structured_output_raises():
    adapter = BatchedEncoderAdapter(TupleTower())
    with pytest.raises(TypeError, match="returned tuple.*GraphableEncoder"):
        adapter.eager_forward(IMAGE_PATH, torch.zeros(2, 4))


def test_empty_batch_runs_tower_for_output_shape():
    adapter = BatchedEncoderAdapter(nn.Linear(4, 6))
    assert adapter.postprocess([], torch.zeros(0, 4)).shape == (0, 6)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="max_batch_size"):
        BatchedEncoderAdapter(nn.Linear(2, 2), max_batch_size=0)
    with pytest.raises(ValueError, match="'global'"):
        BatchedEncoderAdapter(nn.Linear(2, 2)).token_budget_range("global")


def manager_for(tower: nn.Module):
    adapter = BatchedEncoderAdapter(tower, max_batch_size=8)
    return adapter, EncoderGraphManager(adapter, mode="full", capture="first_use")


class ChannelsLastFeatures(nn.Module):
    """A convolution whose feature maps come out channels_last, as a graph of
    channels_last weight copies gives them."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).contiguous(memory_format=torch.channels_last)


def test_replayed_feature_maps_come_back_contiguous():
    torch.manual_seed(0)
    tower = ChannelsLastFeatures().eval()
    manager = EncoderGraphManager(BatchedEncoderAdapter(tower), capture="first_use")
    x = torch.randn(3, 3, 8, 8)
    with torch.no_grad():
        output = manager.execute(manager.encoder.inputs_from_call((x,), {}))
        expected = tower(x)
    assert manager.stats.hits == 1
    assert output.is_contiguous()
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)
    assert output.view(3, -1).shape == (3, 4 * 8 * 8)


@pytest.mark.parametrize("make_tower", [tiny_vit, tiny_resnet])
def test_manager_runs_batches_beyond_the_largest_budget(make_tower):
    tower = make_tower()
    adapter, manager = manager_for(tower)
    x = torch.randn(11, 3, 16, 16)
    with torch.no_grad():
        out = manager.execute(adapter.inputs_from_call((x,), {}))
        torch.testing.assert_close(out, tower(x), rtol=1e-5, atol=1e-5)
        assert manager.execute(adapter.inputs_from_call((x[:0],), {})).shape == (0, 10)
    assert manager.stats.hits == 2 and manager.stats.misses == 0


@pytest.mark.cuda
@pytest.mark.parametrize("make_tower", [tiny_vit, tiny_resnet])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_captured_replay_matches_eager_on_cuda(make_tower, dtype, monkeypatch):
    # TF32 convolutions pick batch-size-dependent kernels (~6e-4 apart on an H200),
    # which would hide real replay errors behind the fp32 tolerance.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    tower = make_tower().to("cuda", dtype)
    adapter, manager = manager_for(tower)
    with torch.no_grad():
        for batch_size in (1, 3, 8, 5):
            x = torch.randn(batch_size, 3, 16, 16, device="cuda", dtype=dtype)
            out = manager.execute(adapter.inputs_from_call((x,), {}))
            tolerance = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out, tower(x), rtol=tolerance, atol=tolerance)
    assert manager.stats.graphs > 0 and manager.stats.misses == 0
