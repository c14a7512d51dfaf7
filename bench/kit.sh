#!/usr/bin/env bash
# The device kit: a wheel of every pin in requirements-gpu.in for CPython 3.12 on manylinux x86-64, into .whl/,
# which bench/gpu.sh installs on a GPU host without network. A pin PyPI has only as an sdist is built here, and
# must build pure-Python (version-independent). Fails past KIT_MAX_MIB (64): the kit holds no torch or CUDA,
# so a bigger one means a pin brought a heavy package along. Needs PyPI.   bench/kit.sh
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "kit: $*" >&2; exit 1; }
py=${PYTHON:-$(if [ -x .venv/bin/python ]; then echo .venv/bin/python; else echo python3; fi)}
pip=("$py" -m pip --disable-pip-version-check -q)
device=(--only-binary=:all: --python-version 3.12 --implementation cp)
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do device+=(--platform "${tag}_x86_64"); done
kit=$(mktemp -d "${TMPDIR:-/tmp}/tts-kit.XXXXXX")
trap 'rm -rf "$kit"' EXIT
mapfile -t pins < <(sed 's/#.*//; /^[[:space:]]*$/d' requirements-gpu.in)
# The pins' device wheels in one pip call; a pin pip finds none for is built here and the call goes again
# without it (one pip process a pin would cost some 20 times pip's start-up).
todo=("${pins[@]}")
while [ "${#todo[@]}" -gt 0 ]; do
  if err=$("${pip[@]}" download --no-deps "${device[@]}" -d "$kit" "${todo[@]}" 2>&1); then
    break
  fi
  missing=$(sed -n 's/.*No matching distribution found for \([^ ]*\).*/\1/p' <<<"$err" | head -n 1)
  [ -n "$missing" ] && printf '%s\n' "${todo[@]}" | grep -qixF -- "$missing" || die "pip download failed: $err"
  "${pip[@]}" wheel --no-deps -w "$kit" "$missing"
  mapfile -t todo < <(printf '%s\n' "${todo[@]}" | grep -vixF -- "$missing")
done
# A wheel built here for this Python (neither pure nor manylinux) would not load on the GPU host's.
if ls "$kit" | grep -v -e '-none-any\.whl$' -e manylinux; then
  die "the wheels above were built for this Python only: pin versions PyPI has as wheels"
fi
count=$(ls "$kit" | wc -l)
[ "$count" -eq "${#pins[@]}" ] || die "$count wheels for ${#pins[@]} pins in requirements-gpu.in"
kib=$(du -sk "$kit" | cut -f1)
max=${KIT_MAX_MIB:-64}
[ "$kib" -le $((max * 1024)) ] || die "$((kib / 1024)) MiB, over KIT_MAX_MIB ($max MiB): which pin brought a heavy package?"
rm -rf .whl
mv "$kit" .whl
echo "kit: $count wheels, $((kib / 1024)) MiB in .whl/"
