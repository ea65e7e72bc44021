"""The Hydra app: the structured config schema, the preflight checks and the runner that
``scripts/predict.py`` and its siblings call.

May import: every other layer, Hydra and OmegaConf.
"""
