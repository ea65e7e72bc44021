"""The transformers towers of bench.py (clip_vit_b16, qwen2_vl_vision) on the CPU, tiny sizes.

End to end through bench.main; the lightning-cg rows' outputs and the exact rows'
graph forward against the transformers eager forward on the same batches.
"""

import json

import pytest
import torch

from bench.hf_towers import CLIP_TOWER, QWEN_TOWER
from bench.main import main
from bench.methods import METHODS, exact_buffers, graph_method
from bench.settings import resolve_settings
from bench.timing import CPU_PATH, NEEDS_CUDA
from bench.workloads import build_tower, tower_workloads
from lightning_cg.adapters import adapter_for

pytest.importorskip("transformers")

TINY_CPU = [
    "tiny=true",
    "device=cpu",
    "dtype=float32",
    "batch_sizes=[1,8]",
    "scenarios=[single_mixed,mixed_8]",
    "packed.single_mixed_batches=3",
    "packed.mixed_8_batches=2",
    "manager.capture=first_use",  # the graph path from the first call
]


def test_transformers_towers_run_end_to_end(tmp_path, one_thread, bench_config):
    output = tmp_path / "bench.json"
    overrides = [
        *TINY_CPU,
        f"workloads=[{CLIP_TOWER},{QWEN_TOWER}]",
        "methods=[eager,lightning-cg,exact]",
        "warmup=0",
        "repeats=1",
        "fail_fast=true",
        f"output={output}",
        "plot=null",
    ]
    main(bench_config(overrides))

    rows = json.loads(output.read_text())
    by_key = {(row["workload"], row["method"]): row for row in rows}
    workloads = {
        f"{CLIP_TOWER}/batch_1": 1,
        f"{CLIP_TOWER}/batch_8": 8,
        f"{QWEN_TOWER}/single_mixed": 3,
        f"{QWEN_TOWER}/mixed_8": 16,
    }
    methods = ["eager", "lightning-cg/full", "exact"]
    assert sorted(by_key) == sorted((w, m) for w in workloads for m in methods)
    for workload, images in workloads.items():
        eager, graph = by_key[(workload, "eager")], by_key[(workload, "lightning-cg/full")]
        assert eager["status"] == "ok" and eager["ms_per_batch"] > 0
        assert eager["images"] == images
        assert graph["status"] == CPU_PATH and graph["vs_eager"] > 0
        assert graph["hit_rate"] == 1.0
        assert by_key[(workload, "exact")]["status"] == NEEDS_CUDA


def _runs(tower_name: str, bench_config):
    """Eager's and the manager's outputs on every batch of every workload of the tower."""
    settings = resolve_settings(bench_config([*TINY_CPU, f"workloads=[{tower_name}]"]))
    tower = build_tower(tower_name, settings.sizes["towers"][tower_name], settings)
    for workload in tower_workloads(tower_name, tower, settings):
        eager = METHODS["eager"].build(tower, workload, settings)
        graph = graph_method(tower, workload, settings)
        with torch.inference_mode():
            for index in range(len(workload.batches)):
                yield tower, workload, index, eager.step(index), graph.step(index)


# CLIP: batches of 1 and 8 images; Qwen: 3 single images, 2 batches of 8.
@pytest.mark.parametrize(("tower_name", "calls"), [(CLIP_TOWER, 2), (QWEN_TOWER, 5)])
def test_lightning_cg_rows_give_the_eager_outputs(tower_name, calls, one_thread, bench_config):
    checked = 0
    for _, _, _, expected, output in _runs(tower_name, bench_config):
        # The tower's own output type, every field equal to transformers' eager forward.
        assert type(output) is type(expected)
        assert output.keys() == expected.keys()
        for field in expected.keys():
            torch.testing.assert_close(output[field], expected[field], rtol=1e-4, atol=1e-5)
        checked += 1
    assert checked == calls


@pytest.mark.parametrize("tower_name", [CLIP_TOWER, QWEN_TOWER])
def test_exact_rows_run_the_graph_forward_on_exactly_the_batch(
    tower_name, one_thread, bench_config
):
    settings = resolve_settings(bench_config([*TINY_CPU, f"workloads=[{tower_name}]"]))
    tower = build_tower(tower_name, settings.sizes["towers"][tower_name], settings)
    encoder = adapter_for(tower)
    for workload in tower_workloads(tower_name, tower, settings):
        for index in range(len(workload.batches)):
            args, kwargs = workload.call(index)
            inputs = encoder.inputs_from_call(args, kwargs)
            with torch.inference_mode():
                # What exact captures: the graph forward on the batch's own rows and
                # precomputed metadata (the Qwen forward gets no grid_thw).
                rows = {
                    path: encoder.graph_forward(path, buffers)
                    for path, buffers in exact_buffers(encoder, inputs, settings)
                }
                output = encoder.postprocess([rows], inputs)
                expected = tower(*args, **kwargs)
            assert len(rows) == 1
            torch.testing.assert_close(
                output.pooler_output, expected.pooler_output, rtol=1e-4, atol=1e-5
            )


def _cuda_rows(tmp_path, bench_config, methods: str, extra: list[str] = ()) -> list[dict]:
    return main(
        bench_config(
            [
                "quick=true",
                "tiny=true",
                "device=cuda",
                "warmup=1",
                "repeats=2",
                f"workloads=[{CLIP_TOWER},{QWEN_TOWER}]",
                "batch_sizes=[1,8]",
                "scenarios=[single_mixed,mixed_8]",
                f"methods=[{methods}]",
                "skip_methods=[]",
                "fail_fast=true",
                f"output={tmp_path / 'bench.json'}",
                "plot=null",
                *extra,
            ]
        )
    )


@pytest.mark.cuda
def test_graph_methods_on_cuda(tmp_path, bench_config):
    # first_use: every lightning-cg row replays graphs (the default policy may
    # rightly keep a workload that fills the GPU eager, capturing nothing).
    rows = _cuda_rows(
        tmp_path, bench_config, "eager,lightning-cg,exact", ["manager.capture=first_use"]
    )
    assert len(rows) == 4 * 3
    for row in rows:
        assert row["status"] == "ok", row
        assert row["ms_per_batch"] > 0 and row["vs_eager"] > 0 and row["vs_exact"] > 0
        if row["method"] != "eager":
            assert row["capture_s"] > 0


@pytest.mark.cuda
@pytest.mark.slow  # torch.compile of transformers towers: minutes
def test_compile_method_on_cuda(tmp_path, bench_config):
    rows = _cuda_rows(tmp_path, bench_config, "eager,compile")
    compiled = [row for row in rows if row["method"] == "compile"]
    assert len(compiled) == 4
    for row in compiled:
        assert row["status"] == "ok", row
        assert row["ms_per_batch"] > 0 and row["capture_s"] >= 0
