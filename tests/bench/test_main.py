"""bench.main end to end on the CPU: quick profile, tiny towers, no CUDA.

Graph and compile rows must say they are unavailable, never carry a timing;
eager and the manager's CPU path run.
"""

import json

import torch

from bench.main import main
from bench.timing import CPU_PATH, NEEDS_CUDA, ROW_KEYS

#: What every row must carry.
REQUIRED_KEYS = (
    "workload",
    "method",
    "ms_per_batch",
    "images_per_s",
    "vs_eager",
    "vs_exact",
    "padding_waste",
    "capture_s",
    "pool_bytes",
    "peak_mem_bytes",
    "status",
)
CPU_RUN = [
    "quick=true",
    "manager.capture=first_use",  # the graph path from the first pass
    "tiny=true",
    "device=cpu",
    "dtype=float32",
    "warmup=1",
    "repeats=2",
    "skip_methods=[]",
    "workloads=[vit_b_16,resnet50,packed_vit_small,stream]",
    "batch_sizes=[1,4]",
    "scenarios=[single_mixed,single_small,mixed_4,small_16,photos]",
    "stream.warmup=0",
    "stream.repeats=1",
]


def test_quick_tiny_run_on_cpu(tmp_path, one_thread, bench_config):
    output, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    main(bench_config([*CPU_RUN, f"output={output}", f"plot={plot}"]))

    rows = json.loads(output.read_text())
    assert all(set(REQUIRED_KEYS) <= set(row) and set(row) == set(ROW_KEYS) for row in rows)
    by_key = {(row["workload"], row["method"]): row for row in rows}
    workloads = [
        "vit_b_16/batch_1",
        "vit_b_16/batch_4",
        "resnet50/batch_1",
        "resnet50/batch_4",
        "packed_vit_small/single_mixed",
        "packed_vit_small/single_small",
        "packed_vit_small/mixed_4",
        "packed_vit_small/small_16",
        "packed_vit_small/photos",
        "stream/packed_vit_small",
    ]
    methods = ["eager", "lightning-cg/full", "exact", "compile"]
    assert sorted(by_key) == sorted((w, m) for w in workloads for m in methods)
    for workload in workloads:
        eager, graph = by_key[(workload, "eager")], by_key[(workload, "lightning-cg/full")]
        assert eager["status"] == "ok" and eager["ms_per_batch"] > 0
        assert eager["vs_eager"] == 1.0 and eager["padding_waste"] == 0.0
        assert graph["status"] == CPU_PATH and graph["ms_per_batch"] > 0
        assert graph["vs_eager"] > 0 and graph["padding_waste"] >= 0
        assert graph["hit_rate"] == 1.0
        for method in ("exact", "compile"):
            row = by_key[(workload, method)]
            assert row["status"] == NEEDS_CUDA
            assert row["ms_per_batch"] is None and row["vs_eager"] is None
        assert all(by_key[(workload, m)]["vs_exact"] is None for m in methods)
        assert all(by_key[(workload, m)]["peak_mem_bytes"] is None for m in methods)
    stream = by_key[("stream/packed_vit_small", "eager")]
    assert stream["batches"] == 50 and stream["total_s"] > 0
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert json.loads(output.with_suffix(".meta.json").read_text())["torch"] == torch.__version__

    merged = tmp_path / "merged.json"
    main(bench_config([f"from_json=[{output}]", f"output={merged}", "plot=null"]))
    assert json.loads(merged.read_text()) == rows
