"""The training run: the actor's update and its micro-batches, the loop's hooks, the reference policy,
DEEP-GRPO, the loop itself, checkpoints, the run directory, the memory plan and ``stapo calibrate``.

The top layer of ``stapo.core``: it may import every layer below (docs/architecture.md,
tests/unit/test_import_layers.py); nothing below imports it.
"""
