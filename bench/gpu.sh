#!/usr/bin/env bash
# The GPU benchmark (bench/gpu.py; bench/README.md says what it measures). The device kit first, where .whl/
# holds one (bench/kit.sh): installed offline into a temporary folder, on PYTHONPATH where this Python lacks ChatTTS.
#   bench/gpu.sh [--quick] [--cpu] [gpu.py's options]    Python: $PYTHON, else .venv/bin/python, else python3
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-$(if [ -x .venv/bin/python ]; then echo .venv/bin/python; else echo python3; fi)}
if compgen -G ".whl/*.whl" >/dev/null; then
  site=$(mktemp -d "${TMPDIR:-/tmp}/tts-kit.XXXXXX")
  trap 'rm -rf "$site"' EXIT
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
