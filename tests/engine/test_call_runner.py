"""CallRunner: what one call charges each key the capture rule is learning."""

import pytest
import torch
from toy_encoder import ToyEncoder, ToyTower

from lightning_cg.engine.manager import EncoderGraphManager


def test_keys_sharing_one_eager_call_are_charged_their_share_of_it():
    tower = ToyTower().eval()
    manager = EncoderGraphManager(ToyEncoder(tower, max_budget=64), budgets={"budgets": [16, 32]})
    charged: dict = {}
    path_calls: list = []
    record_eager, record_eager_call = manager.policy.record_eager, manager.policy.record_eager_call

    def spy_eager(key, seconds, tokens):
        charged[key.descriptor.num_tokens] = (seconds, tokens)
        record_eager(key, seconds, tokens)

    def spy_eager_call(path, tokens, seconds):
        path_calls.append((path, tokens, seconds))
        record_eager_call(path, tokens, seconds)

    manager.policy.record_eager, manager.policy.record_eager_call = spy_eager, spy_eager_call
    # 12 and 30 tokens: two sub-batches, of budgets 16 and 32, run as one eager call.
    tokens, lengths = torch.randn(42, 8), torch.tensor([12, 30])
    with torch.no_grad():
        manager.execute(manager.encoder.inputs_from_call((tokens, lengths), {}))
        manager.runner.timer.collect()

    assert manager.stats.sub_batches == 2 and manager.stats.hits == 0
    [(path, path_tokens, call_seconds)] = path_calls
    assert (path, path_tokens) == ("local", 42)
    assert {budget: tokens for budget, (_, tokens) in charged.items()} == {16: 12, 32: 30}
    # Shares by tokens that add up to the one call, not the whole call each.
    assert sum(seconds for seconds, _ in charged.values()) == pytest.approx(call_seconds)
    assert charged[16][0] * 30 == pytest.approx(charged[32][0] * 12)
