"""bench.methods on CUDA: every graph method captures, replays and is timed."""

import pytest

from bench.main import main


@pytest.mark.cuda
def test_graph_methods_on_cuda(tmp_path, bench_config):
    rows = main(
        bench_config(
            [
                "quick=true",
                "tiny=true",
                "device=cuda",
                "warmup=1",
                "repeats=2",
                "workloads=[vit_b_16,packed_vit_small,stream]",
                "batch_sizes=[1,4]",
                "scenarios=[single_mixed,mixed_4]",
                "fail_fast=true",
                # Graphs at first use: the rows must show a capture on runs this short.
                "manager.capture=first_use",
                f"output={tmp_path / 'bench.json'}",
                "plot=null",
            ]
        )
    )
    for row in rows:
        if row["method"] == "compile":
            assert row["status"].startswith("skipped")
            continue
        assert row["status"] == "ok", row
        assert row["ms_per_batch"] > 0 and row["peak_mem_bytes"] > 0
        assert row["vs_eager"] > 0 and row["vs_exact"] > 0
        if row["method"] != "eager":
            assert row["capture_s"] > 0 and row["pool_bytes"] >= 0
        if row["method"] == "exact":
            assert row["vs_exact"] == 1.0 and row["padding_waste"] == 0.0


@pytest.mark.cuda
def test_compile_method_on_cuda(tmp_path, bench_config):
    rows = main(
        bench_config(
            [
                "quick=true",
                "tiny=true",
                "device=cuda",
                "warmup=1",
                "repeats=2",
                "workloads=[vit_b_16]",
                "batch_sizes=[2]",
                "methods=[eager,compile]",
                "skip_methods=[]",
                "fail_fast=true",
                f"output={tmp_path / 'bench.json'}",
                "plot=null",
            ]
        )
    )
    compiled = rows[-1]
    assert compiled["method"] == "compile" and compiled["status"] == "ok"
    assert compiled["ms_per_batch"] > 0 and compiled["capture_s"] >= 0
