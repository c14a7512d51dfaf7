#!/usr/bin/env bash
# GPU benchmark, one script, under 10 minutes on a machine with a GPU:
# full-size random-weight ChatTTS; real-time factor, chunks/s and memory at
# batch 1/8/32 for float32, bfloat16 and bfloat16 + torch.compile, with each
# one's fidelity against float32; 1 and 2 workers on one GPU, their GPU
# memory and time to first chunk. Prints one table and appends it to
# BENCHMARKS.md (bench/gpu.py says what each figure is). Without CUDA it runs
# a reduced CPU mode on the tiny checkpoint, so it is known to work before a
# GPU is lent.
#   bench/gpu.sh [--quick] [--cpu] [--max-new-token N] [--batch-sizes 1,8,32] [--workers 1,2] [--rounds N]
#
# The device kit: where .whl/ holds wheels (bench/kit.sh collects them, with
# PyPI, before the GPU machine is lent), they are installed first, offline,
# into a temporary folder and imported from there (bench/kit.py install
# --verify). Where this Python lacks ChatTTS (the GPU machine), that folder
# then goes on PYTHONPATH for the bench and its workers; elsewhere the check
# alone runs. The device tool's call, with .whl carried:
#   bash bench/gpu.sh 2>&1 | tee $OUT/gpu.log
# Python: $PYTHON, else .venv/bin/python, else python3.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
site=""
cleanup() { if [ -n "$site" ]; then rm -rf "$site"; fi; }
trap cleanup EXIT
if compgen -G ".whl/*.whl" >/dev/null; then
  site=$(mktemp -d "${TMPDIR:-/tmp}/tts-kit.XXXXXX")
  echo "device kit: installing $(ls .whl/*.whl | wc -l) wheels from .whl/ into $site"
  "$py" bench/kit.py install --target "$site" --verify
  if ! "$py" -c "import ChatTTS" >/dev/null 2>&1; then
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    echo "device kit: on PYTHONPATH"
  fi
else
  echo "device kit: none in .whl/ (bench/kit.sh collects it); using this Python's packages"
fi
"$py" bench/gpu.py "$@"
