"""The graph engine: the encoder protocol, the manager, capture, replay, the call path,
compiled graphs, and data-parallel sharding.

May import: ``lightning_cg.core`` and torch; never Lightning, Hydra or the adapters.
"""
