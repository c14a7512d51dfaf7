#!/usr/bin/env bash
# The GPU benchmark (bench/gpu.py; docs/benchmarks.md says what it measures). The device kit first, where .whl/
# holds one (bench/kit.sh): installed offline into a temporary folder, the worker's modules imported from there,
# and the folder put on PYTHONPATH where this Python lacks ChatTTS.
#   bench/gpu.sh [--quick] [--cpu] [gpu.py's options]    Python: $PYTHON, else .venv/bin/python, else python3
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-$(if [ -x .venv/bin/python ]; then echo .venv/bin/python; else echo python3; fi)}
if compgen -G ".whl/*.whl" >/dev/null; then
  site=$(mktemp -d "${TMPDIR:-/tmp}/tts-kit.XXXXXX")
  trap 'rm -rf "$site"' EXIT
  wheels=(.whl/*.whl)
  if [ "$("$py" -c 'import sys; print(sys.version_info[:2] == (3, 12))')" != True ]; then
    # The compiled wheels are for the kit's CPython 3.12: this Python's own copies of them serve.
    mapfile -t wheels < <(printf '%s\n' "${wheels[@]}" | grep -v -e '-cp312-')
  fi
  echo "device kit: installing ${#wheels[@]} wheels from .whl/ into $site"
  "$py" -m pip --disable-pip-version-check install -q --no-deps --no-index --no-compile --target "$site" "${wheels[@]}"
  # The worker's modules (their imports pull in the rest) and the kit's own, from the folder and not elsewhere.
  "$py" -c 'import sys; sys.path[:0] = [sys.argv[1], "."]
import ChatTTS, vocos, encodec, vector_quantize_pytorch, num2words, cn2an, rq, redis, soundfile, engines.chattts, worker
outside = [m.__name__ for m in (ChatTTS, vocos, rq) if not m.__file__.startswith(sys.argv[1])]
sys.exit(f"device kit: imported from elsewhere: {outside}" if outside else 0)' "$site"
  echo "device kit: imports ok from $site"
  # Whether this Python has ChatTTS, found without importing it (which would import torch and the model stack).
  if ! "$py" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("ChatTTS") is None)'; then
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    echo "device kit: on PYTHONPATH"
  fi
else
  echo "device kit: none in .whl/ (bench/kit.sh collects it); using this Python's packages"
fi
"$py" bench/gpu.py "$@"
