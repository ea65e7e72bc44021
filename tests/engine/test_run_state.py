"""What a manager's capture rule learned outlives it: keys by a text any process gives
them, a state in JSON's types, kept only for the tower, adapter, torch and device it
was measured with."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_cg.adapters.batched import BatchedEncoderAdapter
from lightning_cg.adapters.hf import HFCallSignature, TensorSpec
from lightning_cg.core.dispatcher import BatchDescriptor
from lightning_cg.engine.cache import GraphKey, GraphSet
from lightning_cg.engine.manager import EncoderGraphManager
from lightning_cg.engine.replay import autocast_key
from lightning_cg.engine.run_state import (
    MEASURED_SLOWER,
    REPLAY_DIFFERS,
    key_identity,
    read_plan,
    write_plan,
)

ROOT = Path(__file__).resolve().parents[2]
HOST_SYNC = "CUDA error: operation not permitted when stream is capturing"

#: Adapter signatures as each adapter builds them, written as Python.
SIGNATURES = {
    "batched": "((3, 16, 16), torch.float32, torch.device('cpu'))",
    "packed": "(torch.bfloat16, torch.device('cuda', 0))",
    "qwen": "(torch.float16, torch.device('cpu'), (('output_attentions', False),))",
    "hf": (
        "HFCallSignature(TensorSpec((3, 8, 8), torch.float16, torch.device('cpu')), "
        "(('pixel_mask', TensorSpec((8, 8), torch.int64, torch.device('cpu'))),), (), "
        "(('output_hidden_states', True), ('interpolate_pos_encoding', None)), "
        "(('return_dict', True), ('_attn_implementation', 'sdpa')))"
    ),
}
KEY = "GraphKey(GraphSet({}, (('cuda', torch.bfloat16),)), 'global', BatchDescriptor(256, 4, True))"
NAMES = {
    "torch": torch,
    "HFCallSignature": HFCallSignature,
    "TensorSpec": TensorSpec,
    "GraphKey": GraphKey,
    "GraphSet": GraphSet,
    "BatchDescriptor": BatchDescriptor,
}
IN_ANOTHER_PROCESS = """
import json, sys, torch
from lightning_cg.adapters.hf import HFCallSignature, TensorSpec
from lightning_cg.core.dispatcher import BatchDescriptor
from lightning_cg.engine.cache import GraphKey, GraphSet
from lightning_cg.engine.run_state import key_identity
keys = json.loads(sys.argv[1])
print(json.dumps({name: key_identity(eval(key)) for name, key in keys.items()}))
"""


def key_of(signature: str) -> GraphKey:
    return eval(KEY.format(signature), NAMES)


@pytest.fixture(scope="module")
def identities_elsewhere() -> dict:
    keys = {name: KEY.format(signature) for name, signature in SIGNATURES.items()}
    result = subprocess.run(
        [sys.executable, "-c", IN_ANOTHER_PROCESS, json.dumps(keys)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize("adapter", list(SIGNATURES))
def test_a_key_has_the_same_identity_in_another_process(adapter, identities_elsewhere):
    identity = key_identity(key_of(SIGNATURES[adapter]))
    assert identity is not None and " at 0x" not in identity
    assert identity == identities_elsewhere[adapter]
    assert "torch.bfloat16" in identity and "'global'" in identity


def test_identities_tell_keys_apart_except_by_device_index():
    base = key_identity(key_of("(torch.bfloat16, torch.device('cuda', 0))"))
    assert key_identity(key_of("(torch.bfloat16, torch.device('cuda', 1))")) == base
    for other in (
        "(torch.float16, torch.device('cuda', 0))",
        "(torch.bfloat16, torch.device('cpu'))",
    ):
        assert key_identity(key_of(other)) != base
    signature = eval("(torch.bfloat16, torch.device('cuda', 0))", NAMES)
    no_autocast = GraphKey(GraphSet(signature), "global", BatchDescriptor(256, 4, True))
    assert key_identity(no_autocast) != base


def test_a_key_part_without_a_repr_of_its_own_has_no_identity():
    key = GraphKey(GraphSet((object(),)), "image", BatchDescriptor(4))
    assert key_identity(key) is None


class BatchMean(nn.Module):
    """Rows that depend on the other rows of the batch: a padded graph differs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(6, 5)
        self.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x - x.mean(0))


def linear(width: int = 5) -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(6, width).eval()


def manager_of(tower, adapter=BatchedEncoderAdapter, **options) -> EncoderGraphManager:
    options = {"budgets": {"budgets": [4, 8]}, **options}
    return EncoderGraphManager(adapter(tower), **options)


def call(manager: EncoderGraphManager, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return manager.execute(manager.encoder.inputs_from_call((x,), {}))


def learned_state(tower: nn.Module) -> dict:
    manager = manager_of(tower)
    manager.begin_run()
    for rows in (4, 3, 4, 8, 4):
        call(manager, torch.randn(rows, 6))
    return manager.state_dict()


def plain(value) -> bool:
    """Whether ``value`` holds only JSON's own types (no subclass: a checkpoint loaded
    with ``weights_only`` refuses any other class)."""
    if type(value) is dict:
        return all(type(k) is str and plain(v) for k, v in value.items())
    if type(value) is list:
        return all(plain(v) for v in value)
    return type(value) in (str, int, float, bool, type(None))


def test_a_state_is_json_and_a_new_manager_takes_it_as_it_was():
    tower = linear()
    state = learned_state(tower)
    assert plain(state) and json.loads(json.dumps(state)) == state
    assert state["calls"] == 5 and state["fingerprint"]["device"] == "cpu"
    # Sub-batches hold 4 items at most: the 8-row batch is two; each is budget 4's.
    assert [record["sightings"] for record in state["keys"].values()] == [6]

    later = manager_of(tower)
    assert later.load_state_dict(state) is True
    assert later.state_dict() == state


def test_a_key_whose_replay_differed_stays_eager_in_a_later_manager():
    tower = BatchMean()
    x = torch.randn(3, 6)
    earlier = manager_of(tower, capture="first_use")
    with pytest.warns(UserWarning, match="rows likely interact"):
        call(earlier, x)
    state = earlier.state_dict()
    assert list(state["eager_keys"].values()) == [REPLAY_DIFFERS]

    later = manager_of(tower, capture="first_use")
    later.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = call(later, x)
    with torch.no_grad():
        torch.testing.assert_close(out, tower(x), rtol=0, atol=0)
    assert later.stats.eager_replay_differs == 1 and not later.is_captured()


def test_a_key_measured_slower_is_listed_with_why():
    manager = manager_of(linear())
    manager.begin_run()
    x = torch.randn(4, 6)
    for _ in range(3):
        call(manager, x)
    (record,) = manager.state_dict()["keys"].values()
    assert manager.state_dict()["eager_keys"] == {}
    signature = manager.encoder.graph_signature(manager.encoder.inputs_from_call((x,), {}))
    key = manager.state.plan.key(GraphSet(signature, autocast_key()), "image", [1] * 4, 4)
    eager_seconds = record["eager_seconds_per_token"][0] * 4
    for _ in range(3):
        manager.policy.record_replay(key, 10 * eager_seconds)
    assert manager.state_dict()["eager_keys"] == {key_identity(key): MEASURED_SLOWER}


class Failing(BatchedEncoderAdapter):
    """Capturing raises ``error`` for the budgets ``fails`` picks (None: never)."""

    error: Exception | None = None
    fails = staticmethod(lambda budget: False)
    captured: list[int] = []

    def capture_inputs(self, spec):
        Failing.captured.append(spec.token_budget)
        if Failing.error is not None and Failing.fails(spec.token_budget):
            raise Failing.error
        return super().capture_inputs(spec)


@pytest.mark.parametrize(
    ("error", "fails", "fault", "budgets", "captured"),
    [
        (
            torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
            lambda budget: budget >= 8,
            {"eager_reason": None, "max_budget": 4},
            (4,),
            [4],
        ),
        (RuntimeError(HOST_SYNC), lambda budget: True, "host sync", (4, 8), []),
    ],
    ids=["out_of_memory", "uncapturable"],
)
def test_capture_faults_carry_to_a_later_manager(
    monkeypatch, error, fails, fault, budgets, captured
):
    monkeypatch.setattr(Failing, "captured", [])
    monkeypatch.setattr(Failing, "error", error)
    monkeypatch.setattr(Failing, "fails", staticmethod(fails))
    tower = linear()
    earlier = manager_of(tower, Failing, capture="upfront")
    with pytest.warns(RuntimeWarning, match="capturing"):
        call(earlier, torch.randn(3, 6))
    state = earlier.state_dict()
    if isinstance(fault, dict):
        assert state["faults"] == {"image": fault}
    else:
        assert fault in state["faults"]["image"]["eager_reason"]

    monkeypatch.setattr(Failing, "error", None)
    monkeypatch.setattr(Failing, "captured", [])
    later = manager_of(tower, Failing, capture="upfront")
    with pytest.warns(RuntimeWarning, match="holds capture faults of an earlier run"):
        later.load_state_dict(state)
    call(later, torch.randn(3, 6))
    assert later.paths["image"].budgets == budgets
    assert Failing.captured == captured
    assert later.state_dict()["faults"] == state["faults"]


def other_device(state):
    state["fingerprint"]["device"] = "NVIDIA H100 80GB HBM3"


def other_torch(state):
    state["fingerprint"]["torch"] = "1.0.0"


def bad_sightings(state):
    next(iter(state["keys"].values()))["sightings"] = "many"


def other_format(state):
    state["format"] = 2


def no_calls(state):
    del state["calls"]


def unknown_reason(state):
    state["eager_keys"] = {"k": "felt slow"}


@pytest.mark.parametrize(
    ("spoil", "width", "message"),
    [
        (other_device, 5, "another device: 'NVIDIA H100 80GB HBM3' there, 'cpu' here"),
        (other_torch, 5, "another torch version: '1.0.0' there"),
        (None, 7, "another parameter shapes and dtypes"),
        (bad_sightings, 5, "sightings must be a finite number >= 0; got sightings='many'"),
        (other_format, 5, "cannot be read (format 2, this version reads 1)"),
        (no_calls, 5, "cannot be read (it has no field 'calls')"),
        (unknown_reason, 5, "eager key 'k' has unknown reason 'felt slow'"),
    ],
    ids=[
        "other_device",
        "other_torch",
        "other_tower",
        "bad_field",
        "other_format",
        "missing_field",
        "bad_reason",
    ],
)
def test_a_state_that_does_not_fit_is_ignored_with_one_warning(spoil, width, message):
    state = learned_state(linear())
    if spoil is not None:
        spoil(state)
    manager = manager_of(linear(width))
    with pytest.warns(RuntimeWarning) as warned:
        assert manager.load_state_dict(state, "the test") is False
    messages = [str(w.message) for w in warned if "lightning-cg" in str(w.message)]
    assert len(messages) == 1 and message in messages[0]
    assert messages[0].startswith("lightning-cg: ignoring the plan of the test")
    assert manager.state_dict() == manager_of(linear(width)).state_dict()


def test_a_plan_file_is_written_whole_and_read_back(tmp_path):
    path = tmp_path / "plans" / "plan.json"
    assert read_plan(path) is None
    state = learned_state(linear())
    write_plan(path, state)
    write_plan(path, state)  # over the first: replaced, no temporary left behind
    assert json.loads(path.read_text()) == state == read_plan(path)
    assert os.listdir(path.parent) == ["plan.json"]


def test_a_plan_file_that_cannot_be_read_or_written_warns(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text('{"format": 1, "keys": {')
    with pytest.warns(RuntimeWarning, match="ignoring the plan of file .* cannot be read"):
        assert read_plan(path) is None
    blocked = tmp_path / "plan.json" / "inner.json"  # a file where the folder would be
    with pytest.warns(RuntimeWarning, match="cannot write plan .*inner.json"):
        write_plan(blocked, {"format": 1})
    assert path.read_text() == '{"format": 1, "keys": {'
