"""End-to-end benchmark through the Lightning Trainer (``scripts/bench_trainer.py``).

- :mod:`~bench.trainer.workloads`: towers by name, seeded batches in device memory.
- :mod:`~bench.trainer.module`: a user-style LightningModule timing its tower,
  and a callback recording each run.
- :mod:`~bench.trainer.runs`: predict and fit runs of one method.
- :mod:`~bench.trainer.rows`: rows from runs, merged into a JSON file.
- :mod:`~bench.trainer.suite`: every workload, run length and method.
"""
