"""CapturePolicy's exported state: a later policy that imports it decides as if it had
lived through the earlier runs (scripted timings, through plain JSON)."""

import json
import re

import pytest

from lightning_cg.core.capture_policy import (
    CAPTURE,
    FIRST_CAPTURE_FACTOR,
    NO_GAIN,
    PRIOR_CAPTURE_RATIO,
    PRIOR_GRAPH_RATIO,
    SAMPLES,
    WAIT,
    CapturePolicy,
)
from lightning_cg.core.record_values import path_costs_from_values, record_from_values

#: Calls of a run too short to repay a tower's first capture from its own sightings:
#: at the key's second sighting, ``RUN - 2`` replays each gain half an eager run.
RUN = int(PRIOR_CAPTURE_RATIO * FIRST_CAPTURE_FACTOR / (1 - PRIOR_GRAPH_RATIO))
EAGER_S = 0.01


def see(policy: CapturePolicy, key: str, eager_s: float | None = EAGER_S) -> str:
    """One call whose only sub-batch needs ``key`` (64 real tokens); the decision."""
    policy.called()
    policy.sighted(key, path="local", size=64, tokens=64)
    if eager_s is not None and policy.wants_eager_timing(key):
        policy.record_eager(key, eager_s, 64)
    return policy.decide(key)


def captured_before() -> CapturePolicy:
    """A policy whose tower has had a graph captured (its first capture paid)."""
    policy = CapturePolicy()
    policy.record_capture("an earlier key", 0.0)
    return policy


def exported(policy: CapturePolicy) -> dict:
    """The policy's state through JSON, keys named by themselves."""
    return json.loads(json.dumps(policy.export_state(str)))


def later_policy(state: dict | None, key: str = "a") -> CapturePolicy:
    """A fresh process's policy at the start of a run like the first, given ``state``
    (None: nothing learned), before ``key``'s first sighting."""
    policy = CapturePolicy()
    if state is not None:
        paths = {path: path_costs_from_values(v) for path, v in state["paths"].items()}
        policy.import_state(state["calls"], paths)
        policy.import_record(key, record_from_values(state["keys"][key]))
    policy.begin_run(expected_calls=RUN)
    return policy


def measured_earlier(replay_s: float, capture_s: float) -> dict:
    """The state of a process whose run of ``RUN`` calls captured ``a`` and measured it."""
    earlier = CapturePolicy()
    earlier.begin_run(expected_calls=RUN)
    for _ in range(RUN):
        see(earlier, "a")
    earlier.record_capture("a", seconds=capture_s)
    for _ in range(SAMPLES):
        earlier.record_replay("a", replay_s)
    return exported(earlier)


def test_a_key_whose_measured_capture_the_run_repays_is_captured_at_its_first_sighting():
    # Measured: a replay saves 3/4 of an eager run, the capture costs 3: the RUN - 1
    # calls left repay it at once. Without the plan the key waits for its second
    # sighting, and the prior's first capture (10 eager runs) for more calls than that.
    state = measured_earlier(replay_s=EAGER_S / 4, capture_s=3 * EAGER_S)
    assert see(later_policy(state), "a") == CAPTURE
    assert see(later_policy(None), "a") == WAIT


def test_in_a_run_of_known_length_an_earlier_process_eager_time_buys_no_capture():
    # Measured: the capture costs 25 eager runs, more than a run of RUN calls
    # saves; the earlier process spent RUN - 1 eager runs on the key. A later
    # process's runs of known length capture once their own eager time reaches
    # the capture's cost: at the third run's start, not the first's.
    state = measured_earlier(replay_s=EAGER_S / 4, capture_s=25 * EAGER_S)
    assert state["keys"]["a"]["eager_spent"] == pytest.approx((RUN - 1) * EAGER_S)
    later = later_policy(state)
    assert later.estimates("a")["capture_s"] == pytest.approx(25 * EAGER_S)
    runs = [[see(later, "a") for _ in range(RUN)]]
    for _ in range(2):
        later.begin_run(expected_calls=RUN)
        runs.append([see(later, "a") for _ in range(RUN)])
    assert CAPTURE not in runs[0] + runs[1]
    assert runs[2][0] == CAPTURE


def test_in_a_run_of_unknown_length_an_earlier_process_eager_time_counts():
    # A serving loop (no calls known to come): the RUN - 1 eager runs spent in
    # the earlier process exceed the measured capture, so the key is captured
    # at its first sighting.
    state = measured_earlier(replay_s=EAGER_S / 4, capture_s=15 * EAGER_S)
    later = later_policy(state)
    later.begin_run(expected_calls=None)
    assert see(later, "a") == CAPTURE
    assert see(later_policy(None), "a") == WAIT


@pytest.mark.parametrize(
    ("capture_seconds", "decision"),
    [(EAGER_S, CAPTURE), (None, WAIT)],
    ids=["measured_capture_replaces_the_prior", "prior_capture"],
)
def test_an_imported_capture_time_replaces_the_prior(capture_seconds, decision):
    earlier = captured_before()
    earlier.begin_run(expected_calls=1)
    for _ in range(6):
        see(earlier, "a")
    earlier.record_capture("a", seconds=EAGER_S)
    state = exported(earlier)
    state["keys"]["a"]["capture_seconds"] = capture_seconds
    state["keys"]["a"]["capture_ratio"] = None
    # A run of 5: 4 calls left, each saving half an eager run, repay a capture of one
    # eager run, not the prior's first capture (2 x 5).
    later = CapturePolicy()
    later.import_state(state["calls"], {})
    later.import_record("a", record_from_values(state["keys"]["a"]))
    later.begin_run(expected_calls=5)

    assert see(later, "a") == decision


def test_a_key_measured_slower_than_eager_stays_eager():
    earlier = captured_before()
    earlier.begin_run(expected_calls=None)
    for _ in range(3):
        see(earlier, "a")
    for _ in range(SAMPLES):
        earlier.record_replay("a", 2 * EAGER_S)
    state = exported(earlier)
    assert state["slower"] == ["a"]

    assert see(later_policy(state), "a") == NO_GAIN


def test_a_record_survives_json_unchanged():
    earlier = captured_before()
    earlier.begin_run(expected_calls=None)
    for _ in range(4):
        see(earlier, "a")
    earlier.record_replay("a", EAGER_S / 2)
    earlier.record_capture("a", seconds=3 * EAGER_S)
    state = exported(earlier)
    later = later_policy(state)

    assert exported(later)["keys"] == state["keys"]
    assert exported(later)["paths"] == state["paths"]
    for estimate in ("sightings", "eager_s", "graph_s", "capture_s", "eager_spent_s"):
        assert later.estimates("a")[estimate] == earlier.estimates("a")[estimate], estimate


GOOD = {
    "path": "local",
    "size": 64,
    "sightings": 2,
    "real_tokens": 100,
    "eager_spent": 0.01,
    "eager_seconds_per_token": [1e-4],
    "graph_seconds": [],
    "capture_ratio": None,
    "capture_seconds": None,
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"path": 3}, "path must be a str; got path=3"),
        ({"size": 0}, "size must be a finite number >= 1"),
        ({"sightings": -1}, "sightings must be a finite number >= 0"),
        ({"sightings": 2.5}, "sightings must be a finite number"),
        ({"eager_spent": float("nan")}, "eager_spent must be a finite number"),
        ({"eager_spent": True}, "eager_spent must be a finite number"),
        ({"eager_seconds_per_token": [1e-4] * (SAMPLES + 1)}, "more than 3"),
        ({"graph_seconds": ["fast"]}, "graph_seconds must be a finite number"),
        ({"capture_ratio": "5"}, "capture_ratio must be a finite number"),
        ({"capture_seconds": -1.0}, "capture_seconds must be a finite number >= 0"),
        ({"real_tokens": None}, "real_tokens must be a finite number"),
    ],
    ids=lambda value: repr(value)[:40],
)
def test_a_bad_record_is_refused_naming_the_field(change, message):
    assert record_from_values(GOOD).sightings == 2
    with pytest.raises(ValueError, match=re.escape(message)):
        record_from_values(GOOD | change)


def test_a_record_without_a_field_is_refused_naming_it():
    values = dict(GOOD)
    del values["graph_seconds"]
    with pytest.raises(ValueError, match="graph_seconds is missing"):
        record_from_values(values)


def test_a_first_capture_of_300_eager_calls_is_named_and_not_paid_again_by_a_short_run():
    # A depthwise tower's first capture cost 300 eager calls in a run of 150: the
    # run names it. A later process, given the plan, expects the key's capture at
    # those 300 calls: a run of 150 (149 calls left, each saving 3/4 of one) does
    # not repay it, so that run stays eager instead of paying it again.
    earlier = CapturePolicy()
    earlier.begin_run(expected_calls=150)
    decisions = [see(earlier, "a") for _ in range(150)]
    assert CAPTURE in decisions  # the prior expected 10 eager calls
    earlier.record_capture("a", seconds=300 * EAGER_S)
    for _ in range(SAMPLES):
        earlier.record_replay("a", EAGER_S / 4)
    (costly,) = earlier.costly_captures()
    assert costly.key == "a" and costly.seconds == pytest.approx(300 * EAGER_S)
    state = exported(earlier)

    later = CapturePolicy()
    later.import_state(state["calls"], {})
    later.import_record("a", record_from_values(state["keys"]["a"]))
    later.begin_run(expected_calls=150)
    assert CAPTURE not in [see(later, "a") for _ in range(150)]
