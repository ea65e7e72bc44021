"""The Hydra app: the config schema, the preflight checks and the runner behind ``scripts/``.

May import: every other layer, Hydra and OmegaConf.
"""
