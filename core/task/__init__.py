"""The task a run learns: prompt sources and templates (``data``), which prompts a step takes
(``sampler``), and how a response is graded into a reward (``rewards``).

A layer of ``stapo.core``: it imports the base modules, ``stapo.core.algos`` and ``stapo.core.config``,
never the trainer, rollout or train layers (docs/architecture.md, tests/unit/test_import_layers.py).
"""
