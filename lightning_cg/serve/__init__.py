"""The engine outside Lightning: :func:`~lightning_cg.serve.graphed.graphed` serves a
tower through graph replay in a plain PyTorch loop.

May import: ``lightning_cg.adapters``, ``lightning_cg.engine``, ``lightning_cg.core``
and torch; never Lightning, Hydra, the callback or the app.
"""
