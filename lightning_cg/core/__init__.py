"""The torch-free core: token budgets, packing, the dispatcher's keys, the capture rule's
arithmetic and stats.

May import: the standard library only (no torch, no Lightning, no Hydra), so that
planning and dispatch can be tested and reasoned about without a GPU stack.
"""
