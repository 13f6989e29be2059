"""Code that runs INSIDE the vLLM server's worker processes (their own interpreter and virtualenv).

The launcher puts this directory on the server's ``PYTHONPATH`` and vLLM imports
``gptoss_vllm_worker.GptOssWeightSyncExtension``; that module must import nothing from ``trl_gptoss``.
"""
