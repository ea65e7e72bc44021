"""CompileLifecycle: when compiling is given up, the plans change between calls only."""

import functools

import pytest
import torch
from toy_encoder import ToyEncoder, ToyTower

import lightning_cg.compiled as compiled_module
from lightning_cg.compiled import CompiledEncoder
from lightning_cg.manager import EncoderGraphManager

UNCOMPILED_LADDER = [8, 16, 32, 64]  # the toy's local path, pow2


def call(manager: EncoderGraphManager) -> None:
    """One call of one 30-token item, through the graphs."""
    with torch.no_grad():
        manager.execute(
            manager.encoder.inputs_from_call((torch.randn(30, 8), torch.tensor([30])), {})
        )


def test_giving_up_restores_the_uncompiled_plans_at_the_next_call(monkeypatch):
    monkeypatch.setattr(
        compiled_module, "CompiledEncoder", functools.partial(CompiledEncoder, backend="eager")
    )
    manager = EncoderGraphManager(ToyEncoder(ToyTower().eval()), capture="first_use", compile=True)
    call(manager)
    compiled_ladder = list(manager.paths["local"].budgets)
    assert compiled_ladder != UNCOMPILED_LADDER and len(manager.cache) > 0

    compiling = manager.compiling
    with pytest.warns(RuntimeWarning, match="a failed compile"):
        compiling.compiled_encoder.give_up("a failed compile")
    # A compile fails inside a capture: what is checked and expected changes now,
    # the plans and graphs stay until the next call.
    assert manager.runner.on_compiled_mismatch is None and not manager.policy.costs.graphs_fuse_work
    assert manager.paths["local"].budgets == compiled_ladder and manager.weight_casts is None
    assert len(manager.cache) > 0

    compiling.before_call()
    assert manager.paths["local"].budgets == UNCOMPILED_LADDER
    assert manager.weight_casts is not None and len(manager.cache) == 0
    call(manager)
    compiling.before_call()  # once only: the uncompiled graphs captured since stay
    assert len(manager.cache) > 0
