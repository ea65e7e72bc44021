"""Benchmark lightning-cg against eager, the exact-shape CUDA graph and torch.compile.

    python scripts/bench.py quick=true workloads=[vit_b_16]

Every field is explained in conf/bench.yaml; the logic is in lightning_cg/bench.py.
"""

import sys
from pathlib import Path

try:
    import lightning_cg  # noqa: F401
except ImportError:  # a checkout that is not pip-installed: import it from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra
from omegaconf import DictConfig, OmegaConf

from lightning_cg.bench import main as run_bench


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench")
def main(config: DictConfig) -> None:
    run_bench(OmegaConf.to_container(config, resolve=True))


if __name__ == "__main__":
    main()
