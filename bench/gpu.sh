#!/usr/bin/env bash
# The GPU benchmark (bench/gpu.py; bench/README.md says what it measures), under 10 minutes on a GPU; without
# CUDA a reduced CPU mode on the tiny checkpoint. Installs the device kit from .whl/ first where there is one
# (bench/kit.sh collects it), offline into a temporary folder, on PYTHONPATH where this Python lacks ChatTTS.
#   bench/gpu.sh [--quick] [--cpu] [--max-new-token N] [--batch-sizes 1,8,32] [--workers 1,2] [--rounds N]
# The device tool's call, with .whl carried: bash bench/gpu.sh 2>&1 | tee $OUT/gpu.log
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
