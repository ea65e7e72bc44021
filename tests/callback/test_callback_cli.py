"""Every option of the README's table through a real LightningCLI: the flag its LightningCLI
column gives builds the callback its Python keywords build, and a value outside an option's
choices is refused while the arguments are parsed, listing the choices."""

import dataclasses
import re
from pathlib import Path

import pytest
import yaml
from lightning.pytorch.cli import LightningCLI
from test_callback import RecordingModel

from examples.data.synthetic import SyntheticDataModule
from lightning_cg.callback.graph_callback import CUDAGraphCallback
from lightning_cg.engine.config import BudgetConfig, GraphConfig

README = Path(__file__).resolve().parents[2] / "README.md"
PREFIX = "--trainer.callbacks."
#: Every option a user sets: the callback's own, the graph options, each budgets key.
OPTIONS = [
    "module",
    "stages",
    "adapter",
    "encoder_data_parallel",
    "keep_graphs",
    *(f.name for f in dataclasses.fields(GraphConfig) if f.name != "budgets"),
    *(f"budgets.{f.name}" for f in dataclasses.fields(BudgetConfig)),
]


class CliModel(RecordingModel):
    pass


def callback_from(*flags: str) -> CUDAGraphCallback:
    cli = LightningCLI(
        CliModel,
        SyntheticDataModule,
        run=False,
        args=[
            "--trainer.accelerator=cpu",
            "--trainer.callbacks+=lightning_cg.CUDAGraphCallback",
            *flags,
        ],
    )
    [callback] = [c for c in cli.trainer.callbacks if isinstance(c, CUDAGraphCallback)]
    return callback


def readme_flags() -> dict[str, list[str]]:
    """Per option, the flags of the README options table's row that sets it."""
    section = README.read_text().split("## Options", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) < 4 or not cells[2].startswith(f"`{PREFIX}"):
            continue
        flags = re.split(rf"\s+(?={re.escape(PREFIX)})", cells[2].strip("`"))
        for flag in flags:
            rows[flag.removeprefix(PREFIX).split("=", 1)[0]] = flags
    return rows


def keywords(flags: list[str]) -> dict:
    """The Python keywords the flags stand for."""
    found: dict = {}
    for flag in flags:
        key, value = flag.removeprefix(PREFIX).split("=", 1)
        *outer, name = key.split(".")
        target = found
        for part in outer:
            target = target.setdefault(part, {})
        target[name] = yaml.safe_load(value)
    return found


def settings(callback: CUDAGraphCallback) -> tuple:
    return (
        callback.config,
        callback.stages,
        callback.module,
        callback.adapter,
        callback.keep_graphs,
        callback.encoder_data_parallel,
    )


@pytest.mark.parametrize("option", OPTIONS)
def test_the_readme_flag_of_each_option_sets_it_through_lightning_cli(option):
    flags = readme_flags().get(option)
    assert flags, f"the README's options table gives no LightningCLI flag for {option}"
    through_cli = callback_from(*flags)
    assert settings(through_cli) == settings(CUDAGraphCallback(**keywords(flags)))
    assert settings(through_cli) != settings(CUDAGraphCallback())


# (flag, the value refused, the choices the refusal lists)
OUTSIDE_THE_CHOICES = [
    ("mode=fast", "fast", "'none', 'full', 'full_uniform_only'"),
    ("capture=later", "later", "'paid_back', 'first_use', 'upfront'"),
    ("stages=[validate,fit]", "fit", "'validate', 'test', 'predict'"),
    ("adapter=packd", "packd", "'packed', 'batched', 'hf'"),
    ("config.capture=later", "later", "'paid_back', 'first_use', 'upfront'"),
]


@pytest.mark.parametrize(
    ("flag", "value", "choices"), OUTSIDE_THE_CHOICES, ids=[row[0] for row in OUTSIDE_THE_CHOICES]
)
def test_a_value_outside_the_choices_is_refused_while_parsing(flag, value, choices, capsys):
    with pytest.raises(SystemExit):
        callback_from(f"{PREFIX}{flag}")
    refusal = capsys.readouterr().err
    assert value in refusal and choices in refusal, refusal[-2000:]


def test_options_also_travel_in_a_graph_config():
    # The options beyond the named ones travel in a GraphConfig.
    configured = callback_from(
        "--trainer.callbacks.config=lightning_cg.engine.config.GraphConfig",
        "--trainer.callbacks.config.max_items_per_batch=2",
    )
    assert configured.config.max_items_per_batch == 2
    # A mode inside config is its value, as beside it.
    moded = callback_from("--trainer.callbacks.config.mode=full_uniform_only")
    assert moded.mode.name == "FULL_UNIFORM_ONLY" and moded.config.mode is moded.mode
