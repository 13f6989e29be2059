"""The CPU embedded default: a tiny GPT-OSS and its warm-start (the GRPO job is ``trl_gptoss.scripts.grpo``;
``model_name_or_path: embedded`` selects this model). Its task, exact arithmetic that needs the python tool, is
the ``arithmetic`` row of ``trl_gptoss.data.TASKS`` (``trl_gptoss.data.arithmetic``).

- ``model``: a tiny GPT-OSS over the real o200k Harmony vocabulary, built offline.
- ``demonstrations`` / ``warmstart``: Harmony tool-use demonstrations and the supervised warm-start.
- ``ablation``: the ``sinkless`` attention of the fa2-vs-fa3 ablation (``examples/sink_ablation.py``).
- ``paths``: the packaged YAML of the CPU demo.

Nothing here is imported by ``import trl_gptoss``; submodules load what they need lazily.
"""
