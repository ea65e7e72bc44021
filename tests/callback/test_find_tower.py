"""CUDAGraphCallback() without ``module`` finds the one vision tower of the LightningModule."""

import re

import pytest
import torch
from lightning.pytorch import LightningModule
from test_callback import trainer
from torch import nn
from torch.utils.data import DataLoader
from torchvision.models import resnet18

from examples.models.lit import build_tower
from lightning_cg.adapters.batched import BatchedEncoderAdapter
from lightning_cg.callback.checks import find_tower
from lightning_cg.callback.graph_callback import CUDAGraphCallback

TINY_PACKED = dict(hidden_size=32, depth=1, num_heads=2, patch_size=4, out_hidden_size=16)


class Holder(LightningModule):
    """A LightningModule holding ``modules`` as its children, and a head that is no tower;
    its prediction steps are only counted."""

    def __init__(self, **modules: nn.Module) -> None:
        super().__init__()
        for name, module in modules.items():
            setattr(self, name, module)
        self.head = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 2))
        self.steps = 0

    def predict_step(self, batch, batch_idx):
        self.steps += 1


def predict_with(callback: CUDAGraphCallback, model: Holder) -> None:
    trainer(callback).predict(model, DataLoader(torch.zeros(2, 4), batch_size=2))


def found_at_run_start(model: Holder) -> tuple[str, nn.Module]:
    """The path the callback remembers at a run's start, and the tower it serves."""
    callback = CUDAGraphCallback()
    assert callback.module is None
    predict_with(callback, model)
    return callback.module, callback._tower


def test_a_timm_model_is_one_tower_not_its_blocks():
    timm = pytest.importorskip("timm")
    backbone = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, num_classes=4
    )
    model = Holder(backbone=backbone)
    assert found_at_run_start(model) == ("backbone", backbone)


class FakeTimmBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        return x + self.conv(x)


class FakeTimmNet(nn.Module):
    """Typed like a timm model (by module name), with timm-typed blocks inside."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.blocks = nn.Sequential(FakeTimmBlock(), FakeTimmBlock())

    def forward(self, x):
        return self.blocks(self.stem(x)).mean(dim=(2, 3))


FakeTimmBlock.__module__ = FakeTimmNet.__module__ = "timm.models.fake"


def test_a_timm_typed_stand_in_is_found_at_its_path_and_its_blocks_are_not_towers():
    net = FakeTimmNet()
    model = Holder(encoder=nn.ModuleDict({"net": net}))
    assert found_at_run_start(model) == ("encoder.net", net)


def tiny_clip():
    transformers = pytest.importorskip("transformers")
    common = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    config = transformers.CLIPConfig(
        text_config=dict(
            common, vocab_size=64, max_position_embeddings=16, bos_token_id=0, eos_token_id=1
        ),
        vision_config=dict(common, image_size=32, patch_size=8),
        projection_dim=8,
    )
    return transformers.CLIPModel(config)


def test_the_vision_model_of_a_clip_model_is_the_tower():
    clip = tiny_clip()
    model = Holder(clip=clip)
    # CLIPModel takes pixel_values but also input_ids; its text model takes no images.
    assert found_at_run_start(model) == ("clip.vision_model", clip.vision_model)


def test_two_towers_are_refused_listing_both_paths():
    model = Holder(
        images=resnet18(num_classes=4), videos=build_tower("packed_vit_small", **TINY_PACKED)
    )
    callback = CUDAGraphCallback()
    with pytest.raises(ValueError, match="found 2 vision towers") as refused:
        predict_with(callback, model)
    message = str(refused.value)
    assert "'images' (ResNet)" in message and "'videos' (PackedViT)" in message
    assert "module=" in message
    assert callback.manager is None and callback.module is None and model.steps == 0


def test_a_tower_whose_name_extends_another_towers_is_a_second_tower_not_its_part():
    # "images_hd" starts with "images" but is no submodule of it.
    model = Holder(images=resnet18(num_classes=4), images_hd=resnet18(num_classes=4))
    with pytest.raises(ValueError, match="found 2 vision towers") as refused:
        find_tower(model)
    assert "'images' (ResNet), 'images_hd' (ResNet)" in str(refused.value)


def test_no_tower_is_refused_saying_how_to_name_one():
    model = Holder(body=nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    callback = CUDAGraphCallback()
    with pytest.raises(ValueError, match="found no vision tower in Holder") as refused:
        predict_with(callback, model)
    assert "module='<dotted path>'" in str(refused.value)
    assert "body, head" in str(refused.value)
    assert callback.manager is None and model.steps == 0


def test_a_compiled_tower_is_found_as_its_wrapper():
    tower = resnet18(num_classes=4)
    compiled = torch.compile(tower)
    # The wrapper is the tower: the callback then leaves a compiled tower alone.
    assert find_tower(Holder(vision=compiled)) == ("vision", compiled)


class Classifier(LightningModule):
    """A resnet at a path no default would name, called by predict_step."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleDict({"backbone": resnet18(num_classes=8)})
        self.head = nn.Linear(8, 3)

    def predict_step(self, batch, batch_idx):
        return self.head(self.encoder["backbone"](batch))


def test_predict_through_the_found_tower_equals_eager():
    torch.manual_seed(0)
    model = Classifier().eval()
    images = DataLoader(torch.randn(6, 3, 16, 16), batch_size=3)
    callback = CUDAGraphCallback(capture="first_use")

    graphed = torch.cat(trainer(callback).predict(model, images))
    eager = torch.cat(trainer().predict(model, images))

    assert callback.module == "encoder.backbone"
    assert callback._tower is model.encoder["backbone"]
    torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-5)
    assert callback.last_stats["items"] == 6 and callback.last_stats["hits"] > 0
    assert "forward" not in model.encoder["backbone"].__dict__


class BuiltLate(LightningModule):
    """Builds its tower in ``configure_model`` or ``setup``, which Lightning calls after the
    callbacks' ``setup``, as large models do."""

    def __init__(self, hook: str) -> None:
        super().__init__()
        self.hook = hook
        self.backbone: nn.Module | None = None
        self.head = nn.Linear(8, 3)

    def _build(self) -> None:
        if self.backbone is None:
            torch.manual_seed(0)
            self.backbone = resnet18(num_classes=8).eval()

    def configure_model(self) -> None:
        if self.hook == "configure_model":
            self._build()

    def setup(self, stage: str) -> None:
        if self.hook == "setup":
            self._build()

    def predict_step(self, batch, batch_idx):
        return self.head(self.backbone(batch))


@pytest.mark.parametrize("module", [None, "backbone"])
@pytest.mark.parametrize("hook", ["configure_model", "setup"])
def test_a_tower_built_in_configure_model_or_setup_is_served(hook, module):
    images = DataLoader(torch.randn(4, 3, 16, 16), batch_size=2)
    callback = CUDAGraphCallback(module=module, capture="first_use")
    model = BuiltLate(hook)

    graphed = torch.cat(trainer(callback).predict(model, images))

    assert callback.module == "backbone" and callback._tower is model.backbone
    assert callback.last_stats["items"] == 4 and callback.last_stats["hits"] > 0
    torch.testing.assert_close(graphed, torch.cat(trainer().predict(model, images)))


class Backbone(LightningModule):
    """A resnet at ``backbone``, replaced between runs in the tests below."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.backbone = resnet18(num_classes=4).eval()

    def predict_step(self, batch, batch_idx):
        return self.backbone(batch)


def replace_backbone(model: Backbone) -> None:
    torch.manual_seed(5)
    model.backbone = resnet18(num_classes=4).eval()


class FailingCapture(BatchedEncoderAdapter):
    """Every capture fails with an error the callback turns into eager runs."""

    def capture_inputs(self, spec):
        raise RuntimeError("capture exploded")


def test_a_tower_replaced_after_a_capture_failure_is_served_itself():
    images = DataLoader(torch.randn(6, 3, 32, 32), batch_size=3)
    model = Backbone()
    callback = CUDAGraphCallback(module="backbone", adapter=FailingCapture, capture="first_use")
    run = trainer(callback)
    with pytest.warns(RuntimeWarning, match="capture exploded"):
        run.predict(model, images)
    run.predict(model, images)  # eager: the capture failed
    replace_backbone(model)

    served = torch.cat(run.predict(model, images))  # eager still, through the new tower

    torch.testing.assert_close(served, torch.cat(trainer().predict(model, images)))
    assert callback.last_stats["hits"] == 0 and callback.last_stats["items"] == 6


def test_an_adapter_object_of_another_module_is_refused_naming_both():
    images = DataLoader(torch.randn(6, 3, 32, 32), batch_size=3)
    model = Backbone()
    callback = CUDAGraphCallback(module="backbone", adapter=BatchedEncoderAdapter(model.backbone))
    trainer(callback).predict(model, images)
    replace_backbone(model)
    with pytest.raises(
        ValueError, match="wraps a ResNet that is not the tower at module='backbone'"
    ):
        trainer(callback).predict(model, images)


def test_a_missing_nested_module_names_the_level_that_lacks_it():
    model = Holder(encoder=nn.ModuleDict({"net": nn.Linear(4, 4)}))
    callback = CUDAGraphCallback(module="encoder.nope")
    with pytest.raises(ValueError, match="encoder has no 'nope'; its child modules: net"):
        predict_with(callback, model)
    assert model.steps == 0


def test_a_named_adapter_that_cannot_serve_the_tower_is_refused_before_any_batch():
    model = Holder(clip=tiny_clip())
    callback = CUDAGraphCallback(module="clip.vision_model", adapter="batched")
    with pytest.raises(TypeError, match="use adapter='hf'"):
        predict_with(callback, model)
    assert model.steps == 0


class TwoTowersInAList(LightningModule):
    """Towers in an nn.ModuleList: their paths end in an index."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.towers = nn.ModuleList([resnet18(num_classes=4), resnet18(num_classes=4)]).eval()

    def predict_step(self, batch, batch_idx):
        return self.towers[1](batch)


def test_a_tower_in_a_module_list_is_served_at_the_indexed_path_the_error_suggests():
    model = TwoTowersInAList()
    images = DataLoader(torch.randn(6, 3, 32, 32), batch_size=3)
    with pytest.raises(ValueError, match="module='towers.0'"):
        trainer(CUDAGraphCallback()).predict(model, images)
    callback = CUDAGraphCallback(module="towers.1", capture="first_use")
    graphed = torch.cat(trainer(callback).predict(model, images))
    torch.testing.assert_close(graphed, torch.cat(trainer().predict(model, images)))
    assert callback._tower is model.towers[1] and callback.last_stats["hits"] > 0


class PlainTower(LightningModule):
    """A batch-first tower of no type an adapter is picked for, at ``body``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)).eval()

    def predict_step(self, batch, batch_idx):
        return self.body(batch)


def test_an_adapter_object_names_the_tower_to_find():
    model = PlainTower()
    rows = DataLoader(torch.randn(6, 4), batch_size=3)
    callback = CUDAGraphCallback(adapter=BatchedEncoderAdapter(model.body), capture="first_use")

    graphed = torch.cat(trainer(callback).predict(model, rows))

    assert callback.module == "body" and callback._tower is model.body
    assert callback.last_stats["items"] == 6 and callback.last_stats["hits"] > 0
    torch.testing.assert_close(graphed, torch.cat(trainer().predict(model, rows)))


# (id, adapter of CUDAGraphCallback(module=None), what the refusal says)
ADAPTERS_THAT_FIND_NO_TOWER = [
    (
        "an adapter object of a module outside the model",
        lambda: BatchedEncoderAdapter(nn.Linear(4, 4)),
        "adapter=BatchedEncoderAdapter wraps a Linear that is no submodule of PlainTower",
    ),
    (
        "a name, which says how but not which",
        lambda: "batched",
        "Pass module='<dotted path>' (adapter='batched' says how, not which)",
    ),
]


@pytest.mark.parametrize(
    ("adapter", "named"),
    [row[1:] for row in ADAPTERS_THAT_FIND_NO_TOWER],
    ids=[row[0] for row in ADAPTERS_THAT_FIND_NO_TOWER],
)
def test_an_adapter_that_cannot_tell_the_tower_is_refused_before_any_batch(adapter, named):
    model = PlainTower()
    callback = CUDAGraphCallback(adapter=adapter())
    with pytest.raises(ValueError, match=re.escape(named)):
        trainer(callback).predict(model, DataLoader(torch.randn(2, 4), batch_size=2))
    assert callback.manager is None and "forward" not in model.body.__dict__
