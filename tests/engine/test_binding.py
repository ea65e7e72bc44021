"""TensorBinding: a tower that comes back in new storage keeps its graphs' storage."""

import torch
from torch import nn

from lightning_cg.engine.binding import CHANGED, REBOUND, UNCHANGED, TensorBinding


def tower() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).eval()


def storage(module: nn.Module) -> list[int]:
    tensors = list(module.parameters()) + list(module.buffers())
    return [tensor.data_ptr() for tensor in tensors]


def test_unchanged_storage_is_left_alone():
    module = tower()
    binding = TensorBinding(module)
    with torch.no_grad():
        module[0].weight.add_(1.0)  # an optimizer step: in place
    assert binding.rebind(module) == UNCHANGED


def test_new_storage_gets_its_values_copied_into_the_bound_storage():
    module = tower()
    bound = storage(module)
    binding = TensorBinding(module)
    other = tower()
    with torch.no_grad():
        for tensor in list(other.parameters()) + list(other.buffers()):
            tensor.add_(torch.rand_like(tensor.float()).to(tensor.dtype) + 1)
    module.load_state_dict(other.state_dict(), assign=True)
    parameter = module[0].weight
    assert storage(module) != bound
    assert binding.rebind(module) == REBOUND
    assert storage(module) == bound  # the graphs' addresses again
    assert module[0].weight is parameter  # the Parameter object stays
    for name, value in other.state_dict().items():
        torch.testing.assert_close(module.state_dict()[name], value)
    x = torch.randn(3, 4)
    torch.testing.assert_close(module(x), other(x))


def test_a_copy_of_every_tensor_is_rebound_like_a_device_round_trip():
    module = tower()
    bound = storage(module)
    binding = TensorBinding(module)
    module._apply(lambda tensor: tensor.clone())  # what .cpu() then .cuda() does
    assert storage(module) != bound
    assert binding.rebind(module) == REBOUND and storage(module) == bound


def test_a_changed_shape_or_dtype_or_set_of_tensors_needs_a_recapture():
    for change in (
        lambda module: module.double(),
        lambda module: setattr(module[0], "weight", nn.Parameter(torch.zeros(4, 5))),
        lambda module: module[0].register_buffer("extra", torch.zeros(1)),
    ):
        module = tower()
        binding = TensorBinding(module)
        change(module)
        assert binding.rebind(module) == CHANGED
