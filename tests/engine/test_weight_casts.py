import pytest
import torch
from torch import nn

from lightning_cg.engine.weight_casts import WeightCasts, weight_casts_for


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.norm = nn.LayerNorm(8)
        self.linear = nn.Linear(8, 4)
        self.scale = nn.Parameter(torch.rand(4) + 0.5)  # read outside autocast's casts

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.conv(images).mean(dim=(2, 3))
        return self.linear(self.norm(x)) * self.scale


class ScaledLinear(nn.Linear):
    """A Linear whose forward does more than F.linear: not served."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


def bf16_forward(tower: nn.Module, images: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        return tower(images)


@pytest.fixture
def tower_and_images():
    torch.manual_seed(0)
    return Tower().eval(), torch.randn(2, 3, 6, 6)


def test_copies_give_autocasts_result(tower_and_images):
    tower, images = tower_and_images
    expected = bf16_forward(tower, images)
    casts = WeightCasts(tower)
    with casts.swapped_in(torch.bfloat16):
        assert tower.linear.weight.dtype == tower.conv.bias.dtype == torch.bfloat16
        assert tower.norm.weight.dtype == tower.scale.dtype == torch.float32
        actual = bf16_forward(tower, images)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_convolution_copies_are_channels_last_through_refresh(tower_and_images):
    tower, _ = tower_and_images
    casts = WeightCasts(tower)
    with casts.swapped_in(torch.bfloat16):
        copy = tower.conv.weight
    with torch.no_grad():
        tower.conv.weight.mul_(2.0)
    casts.refresh()
    assert copy.is_contiguous(memory_format=torch.channels_last)
    assert not copy.is_contiguous()
    assert torch.equal(copy, tower.conv.weight.to(torch.bfloat16))


def test_a_tower_with_grouped_convolutions_keeps_its_conv_layout(tower_and_images):
    tower, _ = tower_and_images
    tower.depthwise = nn.Conv2d(8, 8, 3, groups=8)
    casts = WeightCasts(tower)
    with casts.swapped_in(torch.bfloat16):
        copies = (tower.conv.weight, tower.depthwise.weight)
    assert not casts.channels_last
    assert all(copy.is_contiguous() and copy.dtype == torch.bfloat16 for copy in copies)


def test_the_tower_gets_its_own_parameters_back(tower_and_images):
    tower, images = tower_and_images
    before = dict(tower.named_parameters())
    with pytest.raises(RuntimeError), WeightCasts(tower).swapped_in(torch.bfloat16):
        raise RuntimeError("a capture fails")
    after = dict(tower.named_parameters())
    assert all(after[name] is parameter for name, parameter in before.items())


def test_refresh_brings_copies_to_new_weights(tower_and_images):
    tower, images = tower_and_images
    casts = WeightCasts(tower)
    with casts.swapped_in(torch.bfloat16):
        old = bf16_forward(tower, images)
    with torch.no_grad():
        tower.linear.weight.add_(1.0)  # an optimizer step, in place
    expected = bf16_forward(tower, images)
    with casts.swapped_in(torch.bfloat16):
        assert torch.equal(bf16_forward(tower, images), old)  # copies are of the last refresh
    casts.refresh()
    with casts.swapped_in(torch.bfloat16):
        torch.testing.assert_close(bf16_forward(tower, images), expected, rtol=0, atol=0)


def test_clear_drops_the_copies(tower_and_images):
    # Copies made after clear are of the weights then, with no refresh.
    tower, images = tower_and_images
    casts = WeightCasts(tower)
    with casts.swapped_in(torch.bfloat16):
        pass
    with torch.no_grad():
        tower.linear.weight.add_(1.0)
    expected = bf16_forward(tower, images)
    casts.clear()
    with casts.swapped_in(torch.bfloat16):
        torch.testing.assert_close(bf16_forward(tower, images), expected, rtol=0, atol=0)


def test_nbytes_counts_the_copies_of_every_dtype(tower_and_images):
    tower, _ = tower_and_images
    casts = WeightCasts(tower)
    assert casts.nbytes == 0
    served = [tower.conv.weight, tower.conv.bias, tower.linear.weight, tower.linear.bias]
    elements = sum(parameter.numel() for parameter in served)
    with casts.swapped_in(torch.bfloat16):
        pass
    assert casts.nbytes == 2 * elements
    with casts.swapped_in(torch.float16):
        pass
    assert casts.nbytes == 4 * elements
    casts.clear()
    assert casts.nbytes == 0


@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_no_copies_where_nothing_is_cast(tower_and_images, dtype):
    tower, _ = tower_and_images
    casts = WeightCasts(tower)
    with casts.swapped_in(dtype):
        assert tower.linear.weight.dtype == torch.float32


def test_a_linear_with_its_own_forward_keeps_its_weights():
    tower = nn.Sequential(ScaledLinear(4, 4), nn.Linear(4, 4))
    with WeightCasts(tower).swapped_in(torch.bfloat16):
        assert tower[0].weight.dtype == torch.float32
        assert tower[1].weight.dtype == torch.bfloat16


def test_agree_tells_equal_from_different_outputs():
    output = torch.randn(8, 4)
    assert WeightCasts.agree(output.clone(), output, 1e-3)
    assert not WeightCasts.agree(output * 1.01, output, 1e-3)
    assert not WeightCasts.agree(output[:4], output, 1e-3)


def test_weight_casts_for_needs_a_tower_and_the_option(tower_and_images):
    tower, _ = tower_and_images

    class Adapter:
        def __init__(self, tower):
            self.tower = tower

    assert isinstance(weight_casts_for(Adapter(tower), enabled=True), WeightCasts)
    assert weight_casts_for(Adapter(tower), enabled=False) is None
    assert weight_casts_for(Adapter("not a module"), enabled=True) is None
    assert weight_casts_for(object(), enabled=True) is None


# ------------------------------------------------------------ graphs on CUDA


class ReadsWeightOutsideAutocast(nn.Module):
    """A tower that multiplies by a Linear's weight in float32 itself: copies must not serve."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", enabled=False):
            return x.float() @ self.linear.weight.t()


def predict_twice_with_new_weights(tower: nn.Module, images: torch.Tensor):
    """Graph and eager outputs under bf16 autocast, before and after an in-place weight change."""
    from lightning_cg.adapters.batched import BatchedEncoderAdapter
    from lightning_cg.engine.manager import EncoderGraphManager

    manager = EncoderGraphManager(BatchedEncoderAdapter(tower), capture="first_use")
    results = []
    for _ in range(2):
        manager.begin_run()
        with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
            inputs = manager.encoder.inputs_from_call((images,), {})
            graphed = manager.execute(inputs).float()
            eager = tower(images).float()
        results.append((graphed, eager, manager.stats.hits))
        with torch.no_grad():
            for parameter in tower.parameters():
                parameter.mul_(-1.5)  # an in-place step the copies must follow
    return results


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.cuda
def test_graphs_read_copies_refreshed_at_each_run():
    torch.manual_seed(0)
    tower = Tower().eval().cuda()
    images = torch.randn(4, 3, 6, 6, device="cuda")
    for graphed, eager, hits in predict_twice_with_new_weights(tower, images):
        assert hits > 0
        assert relative_error(graphed, eager) < 1e-2


@pytest.mark.cuda
def test_the_stats_count_the_copies_the_graphs_read_until_cleared():
    from lightning_cg.adapters.batched import BatchedEncoderAdapter
    from lightning_cg.engine.manager import EncoderGraphManager

    torch.manual_seed(0)
    tower = Tower().eval().cuda()
    manager = EncoderGraphManager(BatchedEncoderAdapter(tower), capture="first_use")
    manager.begin_run()
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
        manager.execute(
            manager.encoder.inputs_from_call((torch.randn(4, 3, 6, 6, device="cuda"),), {})
        )
    served = [tower.conv.weight, tower.conv.bias, tower.linear.weight, tower.linear.bias]
    assert manager.stats.hits > 0
    assert manager.stats.weight_copy_bytes == 2 * sum(p.numel() for p in served)
    manager.begin_run()
    assert manager.stats.weight_copy_bytes > 0  # held across runs with the graphs
    manager.clear()
    assert manager.stats.weight_copy_bytes == 0


@pytest.mark.cuda
def test_a_tower_reading_weights_outside_autocast_keeps_per_replay_casts():
    torch.manual_seed(0)
    tower = ReadsWeightOutsideAutocast().eval().cuda()
    images = torch.randn(4, 16, device="cuda")
    for graphed, eager, hits in predict_twice_with_new_weights(tower, images):
        assert hits > 0
        assert relative_error(graphed, eager) < 1e-5


@pytest.mark.cuda
@pytest.mark.parametrize(
    "tower_type, forwards_per_capture",
    # Agreeing copies: the first capture warms up without and with them (then
    # records); later ones trust that and warm up once. Disagreeing copies are
    # refused at the first capture, and later captures warm up once without them.
    [(Tower, [3, 2, 2]), (ReadsWeightOutsideAutocast, [3, 2, 2])],
)
def test_the_copies_are_checked_at_the_first_capture_only(tower_type, forwards_per_capture):
    from lightning_cg.adapters.batched import BatchedEncoderAdapter
    from lightning_cg.engine.manager import EncoderGraphManager

    torch.manual_seed(0)
    tower = tower_type().eval().cuda()
    encoder = BatchedEncoderAdapter(tower)
    forwards = []
    graph_forward = encoder.graph_forward

    def counted_graph_forward(path, buffers):
        forwards.append(path)  # before the call: a forward that fails counts too
        return graph_forward(path, buffers)

    encoder.graph_forward = counted_graph_forward
    manager = EncoderGraphManager(encoder, capture="first_use")
    manager.begin_run()
    shape = (3, 6, 6) if tower_type is Tower else (16,)
    captured = []
    for batch in (4, 2, 1):  # three budgets: one capture each
        images = torch.randn(batch, *shape, device="cuda")
        with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
            inputs = manager.encoder.inputs_from_call((images,), {})
            forwards.clear()
            graphed = manager.execute(inputs).float()
            captured.append(len(forwards))
            eager = tower(images).float()
        assert relative_error(graphed, eager) < 1e-2
    assert captured == forwards_per_capture
    assert manager.stats.graphs_captured == 3
