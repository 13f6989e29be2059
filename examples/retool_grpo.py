"""GRPO for GPT-OSS with multi-turn python tool calls (ReTool), on the trl-gptoss trainer.

One script from a 2-core laptop to many GPU nodes; the YAML picks the scale. Every GptOssGRPOConfig field and
every JobArguments field (trl_gptoss/scripts/grpo_arguments.py) can be set in the YAML or overridden on the command
line (``--learning_rate 5e-7``). Bad configs fail before any model loads, with what to change.

CPU, no GPU, no downloads (what ``make demo`` runs; ~9 min on 2 cores: 5.5 min warm-start, 15 GRPO steps of ~12 s):

    accelerate launch --cpu --num_processes 1 examples/retool_grpo.py \
        --config examples/configs/retool_cpu_demo.yaml

GPT-OSS-20B on one 8-GPU node: rollouts on GPUs 0-1 (vLLM, tensor parallel 2), training on GPUs 2-7 (FSDP2):

    CUDA_VISIBLE_DEVICES=0,1 trl-gptoss vllm-serve --model openai/gpt-oss-20b --tensor-parallel-size 2 \
        --port 8000 &
    CUDA_VISIBLE_DEVICES=2,3,4,5,6,7 accelerate launch --config_file examples/configs/accelerate_fsdp2.yaml \
        --num_processes 6 examples/retool_grpo.py --config examples/configs/retool_gpt_oss_20b.yaml

GPT-OSS-120B on several nodes: see examples/configs/retool_gpt_oss_120b.yaml and docs/scaling.md.

Outputs in ``output_dir``: checkpoints, ``trainer_state.json`` (log history), ``plots/*.png``
(``trl-gptoss plot RUN_DIR ...`` redraws and overlays them), ``README.md`` (model card), ``summary.json``.
"""

from trl_gptoss.scripts.grpo import end_distributed, exit_launched_job, parse_job_args, run


def main(argv=None):
    job, training = parse_job_args(argv)  # --config x.yaml plus --field value overrides; checked here
    summary = run(job, training)  # dataset -> model -> GptOssGRPOTrainer.train -> plots, model card, summary
    end_distributed()  # a launched job's process group, destroyed once it succeeded
    return summary


if __name__ == "__main__":
    main()
    exit_launched_job()  # skips the interpreter teardown that gloo runs aborted in now and then
