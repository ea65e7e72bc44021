"""The Lightning glue: :class:`CUDAGraphCallback`, its argument checks, its report and
the trainer-run bookkeeping.

May import: ``lightning_cg.core``, ``lightning_cg.engine``, ``lightning_cg.adapters``,
``lightning_cg.serve`` and Lightning; never Hydra or the app.
"""
