"""The import contracts in pyproject.toml hold, and each kind of breach is caught."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", str(root / "pyproject.toml")],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=False,
    )


def copy_of_the_project(tmp_path: Path) -> Path:
    for name in ("lightning_cg", "examples", "bench"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


def test_the_project_keeps_its_import_contracts():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "forbidden_import", "contract"),
    [
        ("lightning_cg/core/packing.py", "import torch", "The core is pure Python"),
        ("lightning_cg/engine/manager.py", "import lightning_cg.callback.graph_callback", "Layers"),
        ("lightning_cg/engine/capture.py", "import lightning.pytorch", "know nothing of Lightning"),
        ("lightning_cg/adapters/hf.py", "import omegaconf", "know nothing of Lightning"),
        ("lightning_cg/serve/graphed.py", "import lightning.pytorch", "know nothing of Lightning"),
        ("lightning_cg/serve/graphed.py", "import lightning_cg.callback.checks", "Layers"),
        ("lightning_cg/adapters/packed.py", "import lightning_cg.serve.graphed", "Layers"),
        ("lightning_cg/callback/report.py", "import lightning_cg.app.schema", "Layers"),
        ("lightning_cg/adapters/batched.py", "import examples.models.lit", "never imports"),
    ],
)
def test_a_forbidden_import_breaks_its_contract(tmp_path, module, forbidden_import, contract):
    root = copy_of_the_project(tmp_path)
    with open(root / module, "a") as source:
        source.write(f"\n{forbidden_import}  # noqa\n")

    result = lint_imports(root)

    assert result.returncode != 0
    broken = [line for line in result.stdout.splitlines() if line.endswith("BROKEN")]
    assert any(contract in line for line in broken), result.stdout
    assert module.removesuffix(".py").replace("/", ".") in result.stdout
