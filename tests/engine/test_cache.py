"""The graph cache: out of memory at a budget frees that budget's graphs, and the larger
ones, of every signature (their path no longer graphs those budgets)."""

import random
import warnings

import torch
from test_faults import FailingEncoder, out_of_memory
from test_manager import make_batch, run
from toy_encoder import ToyTower

from lightning_cg.engine.manager import BudgetConfig, EncoderGraphManager
from lightning_cg.engine.replay import relative_error


class CastingTower(ToyTower):
    """Casts its tokens to its weights' dtype: float32 and float64 batches are two
    graph signatures of one tower."""

    def body(self, tokens, cu_seqlens):
        return super().body(tokens.float(), cu_seqlens)


def test_out_of_memory_frees_the_graphs_of_every_signature_from_the_failing_budget_up():
    tower = CastingTower().eval()
    encoder = FailingEncoder(
        tower,
        lambda spec: (spec.token_budget, spec.signature[0]) == (32, torch.float32),
        out_of_memory,
    )
    manager = EncoderGraphManager(
        encoder, budgets=BudgetConfig(budgets=[8, 16, 32, 64]), capture="first_use"
    )
    rng = random.Random(0)
    calls = [(torch.float64, [5, 7]), (torch.float64, [30]), (torch.float64, [60])]
    calls += [(torch.float32, [30]), (torch.float64, [30])]  # float32 runs out of memory at 32
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for dtype, lengths in calls:
            tokens, lengths = make_batch(rng, lengths, dtype=dtype)
            assert relative_error(run(manager, tokens, lengths), tower(tokens, lengths)) < 1e-5
    held = {(k.graph_set.signature[0], k.descriptor.num_tokens) for k in manager.cache.keys()}
    # float64's graphs of 32 and 64 tokens went with float32's failure at 32.
    assert held == {(torch.float64, 16)}
    assert list(manager.paths["local"].budgets) == [8, 16]
