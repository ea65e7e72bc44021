"""The Lightning glue: :class:`CUDAGraphCallback`, its argument checks, report and run lengths.

May import: ``lightning_cg.core``, ``engine``, ``adapters``, ``serve`` and Lightning; never
Hydra or the app.
"""
