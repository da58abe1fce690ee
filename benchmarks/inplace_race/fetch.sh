#!/usr/bin/env bash
# Here (PyPI reachable): SGLang 0.5.17's own Python tree for the H200 machine (cp312), beside the kit of
# benchmarks/e2e/fetch_kit.sh: .e2e/sglang-0.5.17.tar.xz (carry it with part1).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
kit="$root/.e2e"
work="$(mktemp -d)"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_34_x86_64 -d "$work" sglang==0.5.17
unzip -qo "$work"/sglang-0.5.17-*.whl 'sglang/*' -d "$work/tree"
find "$work/tree" -name '__pycache__' -prune -exec rm -rf {} +
tar -cJf "$kit/sglang-0.5.17.tar.xz" -C "$work/tree" sglang
rm -rf "$work"
du -sh "$kit/sglang-0.5.17.tar.xz"
