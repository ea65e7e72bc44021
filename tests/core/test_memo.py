"""StateMemo: a value is computed once per lookup and state, and again under a new state."""

from lightning_cg.core.memo import StateMemo


class Counter:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> int:
        self.calls += 1
        return self.calls


def test_a_value_is_computed_once_per_lookup_and_state():
    memo, compute = StateMemo(), Counter()
    assert memo.get("a", (1,), compute) == 1
    assert memo.get("a", (1,), compute) == 1
    assert memo.get("b", (1,), compute) == 2
    assert compute.calls == 2


def test_a_new_state_recomputes_and_replaces_the_entry():
    memo, compute = StateMemo(), Counter()
    old_plan, new_plan = object(), object()
    assert memo.get("a", (old_plan, 8), compute) == 1
    assert memo.get("a", (new_plan, 8), compute) == 2
    assert memo.get("a", (new_plan, 4), compute) == 3
    assert memo.get("a", (new_plan, 4), compute) == 3
    assert memo.get("a", (old_plan, 8), compute) == 4


def test_none_is_a_value_remembered_like_any_other():
    memo, calls = StateMemo(), []
    assert memo.get("a", (), lambda: calls.append(1)) is None
    assert memo.get("a", (), lambda: calls.append(1)) is None
    assert calls == [1]


def test_a_full_memo_starts_over_instead_of_growing():
    memo, compute = StateMemo(size=2), Counter()
    memo.get("a", (), compute)
    memo.get("b", (), compute)
    memo.get("b", (), compute)  # a lookup it holds: nothing dropped
    assert compute.calls == 2
    memo.get("c", (), compute)  # a third: the memo starts over with "c"
    memo.get("c", (), compute)
    assert compute.calls == 3
    memo.get("a", (), compute)
    assert compute.calls == 4
