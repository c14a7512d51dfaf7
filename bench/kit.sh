#!/usr/bin/env bash
# The device kit, in one command: every wheel the offline GPU test machine
# lacks (bench/kit.txt), for CPython 3.12 on manylinux x86-64, into .whl/
# (git-ignored), checked complete and within the device's 64 MiB. Needs PyPI.
# Then, on the device: bench/gpu.sh installs it from .whl/ (carry .whl).
#   bench/kit.sh [--dest DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
exec "$py" bench/kit.py collect "$@"
