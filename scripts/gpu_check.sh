#!/usr/bin/env bash
# The GPU check kit (scripts/gpu_check.py; docs/triton_kernels.md, "GPU check kit"):
#   bash scripts/gpu_check.sh OUTDIR              on a GPU host: every part's JSON, summary.md, within 8 minutes
#   bash scripts/gpu_check.sh OUTDIR --dry-run    on the CPU: the same logic at tiny sizes (run by the suite)
#   bash scripts/gpu_check.sh --stash             the first of two back-to-back device commands (the carry folder)
# PYTHON picks the interpreter (default python3: on the lent GPU host, the one that holds torch). The package runs
# from this checkout through PYTHONPATH, never pip-installed, so its pins cannot replace the host's torch.
set -u
cd "$(dirname "$0")/.." || exit 2
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
