#!/usr/bin/env bash
# The device kit: a wheel of every package the offline GPU machine lacks (requirements-gpu.in) for CPython 3.12
# on manylinux x86-64, into .whl/, checked (bench/kit.py collect). Needs PyPI.   bench/kit.sh [--dest DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-$(if [ -x .venv/bin/python ]; then echo .venv/bin/python; else echo python3; fi)}" bench/kit.py collect "$@"
