"""The CPU embedded default and the main GRPO job behind ``examples/retool_grpo.py`` / ``trl-gptoss grpo``.

- ``task``: a synthetic ReTool-style task (exact arithmetic that needs the python tool), seeded.
- ``model``: a tiny GPT-OSS over the real o200k Harmony vocabulary, built offline.
- ``demonstrations`` / ``warmstart``: Harmony tool-use demonstrations and the supervised warm-start.
- ``arguments`` / ``job`` / ``summary``: config parsing and checks, the run, its plots/model card/summary.
- ``ablation``: the ``sinkless`` attention of the retrospective's fa2-vs-fa3 experiment.

Nothing here is imported by ``import trl_gptoss``; submodules load what they need lazily.
"""
