"""Hydra app: predict with the CUDA graph callback (`python scripts/predict.py --help`)."""

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

# Runs from a checkout without installing the package too.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_cg.app.runner import run_app  # noqa: E402


@hydra.main(version_base="1.3", config_path="../conf", config_name="predict")
def main(cfg: DictConfig) -> None:
    run_app(cfg, "predict")


if __name__ == "__main__":
    main()
