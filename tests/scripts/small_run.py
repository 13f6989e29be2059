"""The GRPO part of a small embedded-default run, shared by the end-to-end and the Ctrl-C tests."""

SMALL_GRPO = [
    "--num_prompts",
    "8",
    "--save_steps",
    "1",
    "--per_device_train_batch_size",
    "4",
    "--num_generations",
    "4",
    "--max_completion_length",
    "64",
]
