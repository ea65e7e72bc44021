"""bench.settings: a bad field of conf/bench.yaml is named in the error."""

import pytest

from bench.settings import resolve_settings


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("workloads=[vit_b_32]", "workloads"),
        ("workloads=[clip_vit_b32]", "workloads"),
        ("workloads=[qwen2_vl]", "workloads"),
        ("scenarios=[mixed_9]", "scenarios"),
        ("methods=[eager,tensorrt]", "methods"),
        ("modes=[fastest]", "modes"),
        ("dtype=int8", "dtype"),
        ("stream.tower=stream", "stream.tower"),
        ("+manager.budgets.smallest=4", "manager.budgets"),
    ],
)
def test_bad_settings_name_the_field(bench_config, override, field):
    with pytest.raises(ValueError, match=field):
        resolve_settings(bench_config(["device=cpu", override]))


def test_an_unknown_workload_lists_the_transformers_towers(bench_config):
    with pytest.raises(
        ValueError, match=r"\['qwen2_vl'\]; allowed: .*clip_vit_b16.*qwen2_vl_vision"
    ):
        resolve_settings(bench_config(["device=cpu", "workloads=[clip_vit_b16,qwen2_vl]"]))
