"""Fields of every dtype through the hf adapter: integer codes, ids and masks beside float
features come back in their own dtype and values, graphed or not."""

from dataclasses import dataclass

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from lightning_cg.serve.graphed import graphed  # noqa: E402

#: Seven items at budgets 1, 2, 4: two sub-batches, the second padded.
GRAPHED = {"capture": "first_use", "budgets": {"max_budget": 4}}
RUNS = [pytest.param(GRAPHED, id="graphed"), pytest.param({"mode": "none"}, id="nothing-graphed")]
FEATURES = [
    pytest.param(torch.float32, id="float32"),
    pytest.param(torch.bfloat16, id="bfloat16"),
    pytest.param(torch.float16, id="float16"),
    pytest.param(None, id="no-features"),
]
#: Codebooks: the values a tower's integer field takes, by dtype and range.
CODEBOOKS = [
    pytest.param(torch.int64, [0, 257, 9_999, 16_383], id="int64-below-2**14"),
    pytest.param(torch.int64, [2**24 + 1, 2**31 + 3, 2**53 + 1, 2**63 - 1], id="int64-above-2**24"),
    pytest.param(torch.int64, [-(2**63), -(2**40) - 1, -(2**24) - 1, -1], id="int64-negative"),
    pytest.param(torch.int32, [0, 2**24 + 1, 2**30 + 7, 2**31 - 1], id="int32-above-2**24"),
    pytest.param(torch.int32, [-(2**31), -(2**24) - 1, -257, -1], id="int32-negative"),
    pytest.param(torch.int16, [-(2**15), -2049, 2049, 2**15 - 1], id="int16-full-range"),
    pytest.param(torch.uint8, [0, 1, 129, 255], id="uint8"),
    pytest.param(torch.bool, [False, True, True, False], id="bool"),
]
TOKENS = 3


@dataclass
class CodesOutput(transformers.utils.ModelOutput):
    """A VQ tokenizer's output: features, each token's code, and which tokens are even."""

    features: torch.Tensor | None = None
    codes: torch.Tensor | None = None
    even: torch.Tensor | None = None


class CodebookTower(nn.Module):
    """Per token, float features and the codebook entry that ``pixel_values[..., 0]`` names."""

    def __init__(self, codebook: torch.Tensor, feature_dtype: torch.dtype | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(4, 6)
        self.register_buffer("codebook", codebook)
        self.feature_dtype = feature_dtype

    def forward(self, pixel_values: torch.Tensor) -> CodesOutput:
        # Clamped: padding rows hold random pixels.
        index = pixel_values[..., 0].long().clamp(0, len(self.codebook) - 1)
        features = None
        if self.feature_dtype is not None:
            features = self.proj(pixel_values).to(self.feature_dtype)
        return CodesOutput(features=features, codes=self.codebook[index], even=index % 2 == 0)


def pixels(items: int, codes: int, device: str = "cpu") -> torch.Tensor:
    """``[items, TOKENS, 4]`` random pixels whose first channel is a code index."""
    x = torch.randn(items, TOKENS, 4, device=device)
    x[..., 0] = torch.randint(codes, (items, TOKENS), device=device).float()
    return x


def assert_exact_codes(got: CodesOutput, want: CodesOutput) -> None:
    for name in ("codes", "even"):
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(got[name], want[name]), (name, got[name], want[name])


@pytest.mark.parametrize("options", RUNS)
@pytest.mark.parametrize("feature_dtype", FEATURES)
@pytest.mark.parametrize(("code_dtype", "values"), CODEBOOKS)
def test_integer_fields_beside_float_features_come_back_exact(
    code_dtype, values, feature_dtype, options
):
    tower = CodebookTower(torch.tensor(values, dtype=code_dtype), feature_dtype).eval()
    x = pixels(7, len(values))
    with torch.no_grad():
        expected = tower(pixel_values=x)
        with graphed(tower, adapter="hf", **options) as served:
            got = tower(pixel_values=x)
    assert type(got) is CodesOutput
    assert_exact_codes(got, expected)
    if feature_dtype is None:
        assert got.features is None
    elif options is GRAPHED:
        assert got.features.dtype == feature_dtype
        torch.testing.assert_close(got.features, expected.features)
    else:
        assert got.features.dtype == feature_dtype
        assert torch.equal(got.features, expected.features)
    assert served.stats["hits"] == (2 if options is GRAPHED else 0)
    assert served.stats["eager_replay_differs"] == 0


@pytest.mark.cuda
@pytest.mark.parametrize("feature_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("code_dtype", "values"), CODEBOOKS[:3] + CODEBOOKS[-1:])
def test_cuda_replayed_integer_fields_are_exact(code_dtype, values, feature_dtype):
    codebook = torch.tensor(values, dtype=code_dtype)
    tower = CodebookTower(codebook, feature_dtype).to("cuda").eval()
    tolerance = 2e-2 if feature_dtype == torch.bfloat16 else 1e-5
    with torch.no_grad(), graphed(tower, adapter="hf", capture="first_use") as served:
        # The first call of each size is checked against eager; the second replays alone.
        for items in (3, 8, 3, 8):
            x = pixels(items, len(values), device="cuda")
            got = tower(pixel_values=x)
            expected = CodebookTower.forward(tower, x)
            assert_exact_codes(got, expected)
            assert got.features.dtype == feature_dtype
            torch.testing.assert_close(
                got.features, expected.features, rtol=tolerance, atol=tolerance
            )
    assert served.stats["graphs"] > 0 and served.stats["hits"] == 4
    assert served.stats["eager_replay_differs"] == 0
