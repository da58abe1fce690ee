#!/usr/bin/env bash
# Download the cp312 manylinux wheels of benchmarks/h200_wheels.txt, plus this package's own wheel,
# into .whl/ (about 47 MB), for a GPU machine with Python 3.12 and no network.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="$root/.whl"
mkdir -p "$dest"
platforms=()
for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${p}_x86_64")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$dest" -r "$root/benchmarks/h200_wheels.txt"
rm -f "$dest"/sglang_lora_tma_guard-*.whl
python3 -m pip wheel -q --no-deps -w "$dest" "$root"
echo "fetched $(ls "$dest" | wc -l) wheels into $dest"
