"""transformers is optional: without it everything else imports and works, and what
needs it says how to install it."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# transformers made unimportable and its metadata unfindable, as if not installed.
WITHOUT_TRANSFORMERS = """
import importlib.metadata as metadata
import sys


class NoTransformers:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "transformers":
            raise ModuleNotFoundError(f"No module named {name!r}")


def without_transformers(lookup):
    def find(name):
        if name == "transformers":
            raise metadata.PackageNotFoundError(name)
        return lookup(name)

    return find


sys.meta_path.insert(0, NoTransformers())
metadata.version = without_transformers(metadata.version)
metadata.distribution = without_transformers(metadata.distribution)

import torch
from torchvision.models import resnet18

import examples.models.hf
from lightning_cg import CUDAGraphCallback
from lightning_cg.adapters import adapter_for
from lightning_cg.engine.manager import EncoderGraphManager

tower = resnet18(num_classes=4).eval()
manager = EncoderGraphManager(adapter_for(tower))
x = torch.randn(3, 3, 32, 32)
with torch.no_grad():
    assert torch.allclose(manager.execute(manager.encoder.inputs_from_call((x,), {})), tower(x))
CUDAGraphCallback(module="backbone")
for needs_transformers in (
    lambda: adapter_for(torch.nn.Linear(2, 2), "hf"),
    examples.models.hf.clip_vision_tower,
):
    try:
        needs_transformers()
    except ImportError as error:
        assert "pip install 'lightning-cg[hf]'" in str(error), error
    else:
        raise AssertionError("no ImportError without transformers")
assert "transformers" not in sys.modules
print("ok")
"""


def test_everything_else_works_without_transformers():
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_TRANSFORMERS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
