"""Benchmark lightning-cg against eager, the exact-shape CUDA graph and torch.compile.

    python scripts/bench.py quick=true workloads=[vit_b_16]

Every field is explained in conf/bench.yaml; the logic is in the bench/ package.
"""

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

# bench/ is never installed, and this file's name would shadow it: the repo root comes first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.main import main as run_bench  # noqa: E402


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench")
def main(config: DictConfig) -> None:
    run_bench(OmegaConf.to_container(config, resolve=True))


if __name__ == "__main__":
    main()
