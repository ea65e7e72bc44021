"""Shared set-up of the benchmark's tests: conf/bench.yaml composed with overrides."""

from collections.abc import Callable
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

CONF = Path(__file__).resolve().parents[2] / "conf"


@pytest.fixture
def bench_config() -> Callable[[list[str]], dict]:
    """``conf/bench.yaml`` with Hydra overrides, as plain Python values."""

    def compose_bench(overrides: list[str]) -> dict:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return OmegaConf.to_container(compose("bench", overrides=overrides), resolve=True)

    return compose_bench
