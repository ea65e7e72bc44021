"""Benchmark: lightning-cg against eager, the exact-shape CUDA graph and torch.compile.

Plain functions behind ``scripts/bench.py`` (a Hydra app; every field is
explained in ``conf/bench.yaml``). One run builds each tower with random
weights, builds its workloads from seeded random data (and the bundled photos),
and times every method on every workload in this one process:

- ``eager``: the tower as it is, cast to ``dtype``, under ``torch.inference_mode``.
- ``lightning-cg/<mode>``: :class:`~lightning_cg.engine.manager.EncoderGraphManager` on
  ``adapter_for(tower)``, one row per configured mode.
- ``exact``: one CUDA graph per batch, captured on exactly that batch's rows
  (the adapter's graph forward, no padding, no packing, no copies): the limit
  of any graph method.
- ``compile``: ``torch.compile(tower, mode="reduce-overhead")``.

A pass runs every batch of a workload once; a row reports the median pass over
``repeats`` passes after ``warmup`` passes, divided by the batches of a pass.
Without CUDA the ``exact`` and ``compile`` rows say ``unavailable: needs CUDA``
and the manager runs its CPU path (no capture). A new method is one function
``(tower, workload, settings) -> Runner`` added to :data:`bench.methods.METHODS`.

Modules, one job each:

- :mod:`bench.settings`: ``conf/bench.yaml`` resolved and checked as ``BenchSettings``.
- :mod:`bench.workloads`: towers with seeded random weights and the batches they run.
- :mod:`bench.hf_towers`: the transformers towers (CLIP ViT-B/16, the Qwen2-VL-7B
  vision tower) of both benchmarks, and how their users call them.
- :mod:`bench.methods`: the ways to run a tower, one ``Runner`` each.
- :mod:`bench.timing`: one method on one workload, timed, as one row.
- :mod:`bench.report`: ratios, the JSON rows, the plot and the table.
- :mod:`bench.main`: the entry point, every method on every workload, then the report.

Not part of the installed package: the scripts put the repository root on ``sys.path``.

Example:
    ``python scripts/bench.py quick=true workloads=[vit_b_16]``, or from Python
    ``bench.main.main(OmegaConf.to_container(compose("bench", overrides)))``.
"""
