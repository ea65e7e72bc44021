import pytest
import torch
from torch import nn

from lightning_cg.adapters.packed_call import read_packed_call, tower_device


class Root(nn.Module):
    """Parameters on children, a None child and a None parameter, and the root's own
    parameter registered after its children: it still comes first (a module's own
    parameters precede its children's), on the CPU where the first child's are on meta."""

    def __init__(self) -> None:
        super().__init__()
        self.empty = nn.Sequential(nn.ReLU(), None)
        self.register_parameter("unset", None)
        self.body = nn.Sequential(nn.Identity(), nn.Linear(2, 2, device="meta"))
        self.scale = nn.Parameter(torch.ones(1))


@pytest.mark.parametrize(
    "tower",
    [
        Root(),
        nn.Sequential(nn.ReLU(), nn.Sequential(nn.Linear(2, 2, device="meta")), nn.Linear(2, 2)),
        nn.Sequential(nn.ReLU()),
    ],
)
def test_tower_device_is_that_of_the_first_parameter(tower):
    first = next(tower.parameters(), None)
    assert tower_device(tower) == (None if first is None else first.device)


def test_tower_device_of_a_root_with_its_own_parameter_first():
    tower = Root()
    tower.register_parameter("unset", nn.Parameter(torch.ones(1, device="meta")))
    assert tower_device(tower) == torch.device("meta") == next(tower.parameters()).device


@pytest.mark.parametrize("method", ["parameters", "named_parameters", "named_modules"])
def test_tower_device_of_a_tower_that_overrides_how_its_parameters_are_found(method):
    elsewhere = nn.Linear(2, 2, device="meta")
    overrides = {
        "parameters": lambda self, recurse=True: elsewhere.parameters(),
        "named_parameters": lambda self, *args, **kwargs: elsewhere.named_parameters(),
        "named_modules": lambda self, *args, **kwargs: elsewhere.named_modules(),
    }
    tower = type("Tower", (nn.Linear,), {method: overrides[method]})(2, 2)
    assert tower_device(tower) == torch.device("meta") == next(tower.parameters()).device


def test_tower_device_of_a_tower_that_is_no_module():
    class Tower:
        def parameters(self):
            return iter([torch.ones(1, device="meta")])

    assert tower_device(Tower()) == torch.device("meta")


def test_a_grid_on_the_meta_device_is_refused_by_name():
    patches = torch.zeros(16, 48)
    grid_thw = torch.tensor([[1, 4, 4]], device="meta")
    with pytest.raises(ValueError, match="grid_thw is on the meta device, which holds no values"):
        read_packed_call(patches, grid_thw, patch_dim=48, merge=1, device=None)
    assert read_packed_call(patches, torch.tensor([[1, 4, 4]]), 48, 1, None) == [(1, 4, 4)]


@pytest.mark.parametrize(
    "thw",
    [[0, 2, 2], [1, 0, 2], [1, 2, 0], [-1, 2, 2], [1, 2, 3]],
    ids=["no-frames", "no-rows", "no-columns", "negative-frames", "columns-not-merged"],
)
def test_an_empty_or_unmergeable_item_is_refused_by_its_index(thw):
    grid_thw = torch.tensor([[1, 2, 2], thw])
    rows = 4 + max(0, thw[0] * thw[1] * thw[2])
    t, h, w = thw
    with pytest.raises(ValueError, match=rf"grid_thw\[1\] is \[{t}, {h}, {w}\]; frames must be"):
        read_packed_call(torch.zeros(rows, 48), grid_thw, patch_dim=48, merge=2, device=None)
