"""Hugging Face transformers towers through the hf adapter: the manager and the callback
against the towers' own eager forward, field by field."""

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.data import DataLoader

transformers = pytest.importorskip("transformers")

from lightning.pytorch import LightningModule  # noqa: E402
from output_checks import assert_same_output as same_output  # noqa: E402
from test_callback import trainer  # noqa: E402

from lightning_cg.adapters import adapter_for  # noqa: E402
from lightning_cg.adapters.batched import IMAGE_PATH  # noqa: E402
from lightning_cg.adapters.hf import HFEncoderAdapter  # noqa: E402
from lightning_cg.callback.graph_callback import CUDAGraphCallback  # noqa: E402
from lightning_cg.engine.compiled import CompiledEncoder  # noqa: E402
from lightning_cg.engine.manager import BudgetConfig, EncoderGraphManager  # noqa: E402

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8)
KINDS = ["clip", "siglip", "dinov2", "vit"]
#: Seven items at budgets 1, 2, 4: two sub-batches, the second padded.
BUDGETS = BudgetConfig(max_budget=4)


def tiny_tower(kind: str, attention: str = "sdpa") -> nn.Module:
    torch.manual_seed(0)
    if kind == "clip":
        config = transformers.CLIPVisionConfig(**TINY, intermediate_size=64)
        tower = transformers.CLIPVisionModel(config)
    elif kind == "siglip":
        config = transformers.SiglipVisionConfig(**TINY, intermediate_size=64)
        tower = transformers.SiglipVisionModel(config)
    elif kind == "dinov2":
        tower = transformers.Dinov2Model(transformers.Dinov2Config(**TINY, mlp_ratio=2))
    else:
        config = transformers.ViTConfig(**TINY, intermediate_size=64)
        tower = transformers.ViTModel(config, use_mask_token=True)
    tower.config._attn_implementation = attention
    return tower.eval()


def manager_for(tower: nn.Module, **kwargs) -> EncoderGraphManager:
    return EncoderGraphManager(
        HFEncoderAdapter(tower), budgets=BUDGETS, **kwargs, capture="first_use"
    )


def execute(manager: EncoderGraphManager, *args, **kwargs):
    with torch.no_grad():
        return manager.execute(manager.encoder.inputs_from_call(args, kwargs))


def eager(tower: nn.Module, *args, **kwargs):
    with torch.no_grad():
        return tower(*args, **kwargs)


def assert_same_output(actual, expected, tolerance: float = 1e-5) -> None:
    """Same type, fields, nesting and values (:mod:`output_checks`), every tensor contiguous."""
    same_output(actual, expected, tolerance)
    assert all(leaf.is_contiguous() for leaf in tree_flatten(actual)[0] if leaf is not None)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"output_hidden_states": True},
        {"output_hidden_states": True, "return_dict": False},
    ],
    ids=["plain", "hidden_states", "tuple"],
)
def test_each_tower_through_the_manager_equals_its_eager_forward(kind, options):
    tower = tiny_tower(kind)
    manager = manager_for(tower)
    x = torch.randn(7, 3, 32, 32)
    expected = eager(tower, pixel_values=x, **options)
    assert_same_output(execute(manager, pixel_values=x, **options), expected)
    assert_same_output(execute(manager, x, **options), expected)
    assert manager.stats.hits == 4 and manager.stats.misses == 0
    assert manager.stats.padded_tokens == 2
    if options.get("return_dict") is False:
        assert isinstance(expected, tuple) and len(expected[2]) == 3
    else:
        assert expected.attentions is None
    assert type(adapter_for(tower)) is HFEncoderAdapter


def test_attentions_are_returned_per_item():
    tower = tiny_tower("clip", attention="eager")
    manager = manager_for(tower)
    x = torch.randn(5, 3, 32, 32)
    out = execute(manager, x, output_attentions=True, output_hidden_states=True)
    expected = eager(tower, x, output_attentions=True, output_hidden_states=True)
    assert len(out.attentions) == 2 and out.attentions[0].shape == (5, 2, 17, 17)
    assert_same_output(out, expected)


@pytest.mark.parametrize("kind", ["clip", "siglip", "vit"])
def test_interpolate_pos_encoding_at_another_image_size(kind):
    tower = tiny_tower(kind)
    manager = manager_for(tower)
    small, large = torch.randn(3, 3, 32, 32), torch.randn(3, 3, 48, 48)
    for x in (small, large, small):
        out = execute(manager, x, interpolate_pos_encoding=True)
        assert_same_output(out, eager(tower, x, interpolate_pos_encoding=True))
    # 48 px has 36 patches, 32 px 16: each size ran on its own graphs.
    assert out.last_hidden_state.shape[1] in (16, 17)
    assert manager.stats.misses == 0


def test_dinov2_interpolates_at_another_image_size():
    tower = tiny_tower("dinov2")
    manager = manager_for(tower)
    x = torch.randn(3, 3, 48, 48)
    assert_same_output(execute(manager, x), eager(tower, x))


def test_flags_of_one_call_do_not_leak_into_the_next():
    tower = tiny_tower("clip")
    manager = manager_for(tower)
    x = torch.randn(3, 3, 32, 32)
    for options in ({}, {"output_hidden_states": True}, {"return_dict": False}, {}):
        assert_same_output(execute(manager, x, **options), eager(tower, x, **options))


def test_config_flags_are_honoured():
    tower = tiny_tower("clip")
    manager = manager_for(tower)
    x = torch.randn(3, 3, 32, 32)
    assert_same_output(execute(manager, x), eager(tower, x))
    tower.config.output_hidden_states = True
    out = execute(manager, x)
    assert len(out.hidden_states) == 3
    assert_same_output(out, eager(tower, x))


@pytest.mark.parametrize("kind", ["dinov2", "vit"])
def test_per_item_masks_are_split_with_their_items(kind):
    tower = tiny_tower(kind)
    manager = manager_for(tower)
    x = torch.randn(7, 3, 32, 32)
    masked = torch.rand(7, 16) < 0.5
    out = execute(manager, x, bool_masked_pos=masked)
    assert_same_output(out, eager(tower, x, bool_masked_pos=masked))
    assert not torch.allclose(out.last_hidden_state, eager(tower, x).last_hidden_state)


class ScaledTower(nn.Module):
    """A batch-first tower with a whole-batch tensor argument that returns a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 6)

    def forward(self, pixel_values, scale, attention_mask=None, squared: bool = False):
        tokens = self.proj(pixel_values) * scale
        if attention_mask is not None:
            tokens = tokens * attention_mask.unsqueeze(-1)
        return {"tokens": tokens**2 if squared else tokens, "pooled": tokens.mean(1), "none": None}


def test_a_dict_tower_with_shared_and_per_item_tensors():
    torch.manual_seed(0)
    tower = ScaledTower()
    manager = manager_for(tower)
    x, scale, mask = torch.randn(7, 3, 4), torch.randn(6), torch.rand(7, 3)
    for squared in (False, True):
        out = execute(manager, x, scale, attention_mask=mask, squared=squared)
        assert_same_output(out, eager(tower, x, scale, attention_mask=mask, squared=squared))
    assert out["none"] is None
    other_scale = torch.randn(6)
    assert_same_output(execute(manager, x, other_scale), eager(tower, x, other_scale))


class MixedPrecisionTower(nn.Module):
    """Returns a field that autocast computes in bfloat16 beside one it leaves in float32."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 6)

    def forward(self, pixel_values):
        return self.proj(pixel_values), pixel_values.float() * 2


def test_fields_keep_their_dtypes_with_and_without_autocast():
    torch.manual_seed(0)
    tower = MixedPrecisionTower()
    manager = manager_for(tower)
    x = torch.randn(5, 4)
    for autocast in (True, False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = execute(manager, x)
            expected = eager(tower, x)
        assert expected[0].dtype == (torch.bfloat16 if autocast else torch.float32)
        assert_same_output(out, expected)


def test_gradients_flow_when_grad_is_enabled():
    tower = tiny_tower("clip")
    manager = manager_for(tower)
    out = manager.execute(manager.encoder.inputs_from_call((torch.randn(2, 3, 32, 32),), {}))
    out.pooler_output.sum().backward()
    assert all(parameter.grad is not None for parameter in tower.parameters())


def test_empty_batch_returns_the_towers_own_empty_output():
    tower = ScaledTower()
    manager = manager_for(tower)
    x, scale = torch.randn(0, 3, 4), torch.randn(6)
    assert_same_output(execute(manager, x, scale), eager(tower, x, scale))


@pytest.mark.slow  # dynamo traces the tower: seconds
def test_a_compiled_graph_forward_learns_the_output_layout_eagerly():
    tower = tiny_tower("clip")
    encoder = CompiledEncoder(HFEncoderAdapter(tower), backend="eager")
    manager = EncoderGraphManager(encoder, budgets=BUDGETS, capture="first_use")
    x = torch.randn(3, 3, 32, 32)
    assert_same_output(execute(manager, x), eager(tower, x))


# ---------------------------------------------------------------- errors


def test_batched_adapter_on_a_transformers_tower_is_refused_naming_the_hf_adapter():
    with pytest.raises(TypeError, match="returns a ModelOutput.*CLIPVisionModel, use adapter='hf'"):
        adapter_for(tiny_tower("clip"), "batched")


def test_packed_adapter_on_a_batch_first_tower_names_the_adapter_that_fits():
    with pytest.raises(
        TypeError, match="CLIPVisionModel takes its items as batch rows: use adapter='hf'"
    ):
        adapter_for(tiny_tower("clip"), "packed")


def test_packed_adapter_on_another_tower_names_what_it_lacks():
    with pytest.raises(TypeError, match="Linear lacks host_metadata().*config.global_grid"):
        adapter_for(nn.Linear(2, 2), "packed")


def test_a_tower_no_adapter_fits_names_its_type_and_the_adapters():
    with pytest.raises(ValueError, match="type Linear.*adapter='batched'.*adapter='hf'"):
        adapter_for(nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"attention_mask": torch.zeros(2, 3)}, "attention_mask has shape \\[2, 3\\].*3 rows"),
        ({"squared": [True]}, "squared=.*hashable"),
        ({"pixel_values": None}, "pixel_values is NoneType"),
        ({"images": torch.zeros(3, 3, 32, 32)}, "does not bind"),
    ],
)
def test_bad_calls_name_the_argument(kwargs, message):
    adapter = HFEncoderAdapter(ScaledTower())
    call = {"pixel_values": torch.zeros(3, 3, 32, 32), "scale": torch.ones(6), **kwargs}
    with pytest.raises(ValueError, match=message):
        adapter.inputs_from_call((), call)


class PooledOnlyOnceTower(nn.Module):
    def forward(self, pixel_values):
        return pixel_values, pixel_values.sum()


def test_an_output_without_items_as_rows_names_the_field():
    adapter = HFEncoderAdapter(PooledOnlyOnceTower())
    inputs = adapter.inputs_from_call((torch.zeros(3, 4),), {})
    with pytest.raises(TypeError, match=r"\[1\] has shape \[\] for a batch of 3 items"):
        adapter.eager_forward(IMAGE_PATH, inputs)


def test_without_transformers_the_hf_adapter_names_the_extra(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)
    with pytest.raises(ImportError, match=r"pip install 'lightning-cg\[hf\]'"):
        adapter_for(ScaledTower(), "hf")


# ------------------------------------------------------- through the callback


class Backbone(LightningModule):
    """A user's module: the tower at ``backbone``, called as users call it."""

    def __init__(self, tower: nn.Module, **options) -> None:
        super().__init__()
        self.backbone = tower
        self.options = options

    def predict_step(self, batch, batch_idx):
        return self.backbone(pixel_values=batch, **self.options)


@pytest.mark.parametrize(
    ("kind", "options"),
    [
        ("clip", {}),
        ("siglip", {"output_hidden_states": True, "return_dict": False}),
        ("dinov2", {"output_hidden_states": True}),
        ("vit", {"return_dict": False}),
    ],
)
def test_through_the_callback_with_no_user_code(kind, options):
    model = Backbone(tiny_tower(kind), **options)
    batches = DataLoader(list(torch.randn(3, 5, 3, 32, 32)), batch_size=None)
    callback = CUDAGraphCallback(module="backbone", budgets={"max_budget": 4}, capture="first_use")
    graphed = trainer(callback).predict(model, batches)
    expected = trainer().predict(model, batches)
    for got, want in zip(graphed, expected, strict=True):
        assert_same_output(got, want)
    assert callback.last_stats["hits"] == 6 and callback.last_stats["items"] == 15


# ------------------------------------------------------------------- CUDA


def clip_vit_b16_bf16() -> nn.Module:
    from examples.models.hf import clip_vision_tower

    torch.manual_seed(0)
    return clip_vision_tower().to("cuda", torch.bfloat16).eval()


@pytest.mark.cuda
@pytest.mark.parametrize("batch_size", [1, 8])
@pytest.mark.parametrize("options", [{}, {"output_hidden_states": True}], ids=["plain", "hidden"])
def test_clip_vit_b16_bf16_graphs_match_eager_sdpa(batch_size, options):
    tower = clip_vit_b16_bf16()
    assert tower.config._attn_implementation == "sdpa"
    manager = EncoderGraphManager(
        HFEncoderAdapter(tower), budgets=BudgetConfig(max_budget=8), capture="first_use"
    )
    for _ in range(2):
        x = torch.randn(batch_size, 3, 224, 224, device="cuda", dtype=torch.bfloat16)
        out = execute(manager, x, **options)
        assert_same_output(out, eager(tower, x, **options), tolerance=2e-2)
    assert manager.stats.graphs > 0 and manager.stats.hits == 2 and manager.stats.misses == 0


@pytest.mark.cuda
def test_clip_through_the_callback_in_bf16_mixed_on_cuda():
    model = Backbone(tiny_tower("clip"), output_hidden_states=True)
    batches = DataLoader([torch.randn(n, 3, 32, 32) for n in (1, 8, 3, 8)], batch_size=None)
    callback = CUDAGraphCallback(module="backbone", budgets={"max_budget": 8}, capture="first_use")
    options = dict(accelerator="gpu", devices=1, precision="bf16-mixed")
    graphed = trainer(callback, **options).predict(model, batches)
    expected = trainer(**options).predict(model, batches)
    for got, want in zip(graphed, expected, strict=True):
        assert_same_output(got, want, tolerance=2e-2)
    assert callback.last_stats["graphs"] > 0 and callback.last_stats["hits"] == 4
