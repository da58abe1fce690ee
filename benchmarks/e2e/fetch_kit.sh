#!/usr/bin/env bash
# Here (a CPU machine with PyPI): build the kit that runs a real SGLang 0.5.16 server on the offline
# H200 machine, from the cp312 wheels of benchmarks/e2e/wheels.txt, and this package's own wheel.
#   .e2e/part1.tar.xz, .e2e/part2.tar.xz   the unpacked site-packages, trimmed, in two parts
#   .e2e/extra/*.whl                       small wheels installed there with pip
#   .e2e/sglang_lora_tma_guard-*.whl       the plugin
# Trimmed: from sglang-kernel, FlashAttention 3 (flash_ops.abi3.so, 1.1 GB) and the sm100 / infllm /
# flashmla libraries (a Triton-attention server on an H200 needs none of them); xgrammar's static
# library. Kept: flashinfer/data (its JIT compiles RMSNorm from data/csrc at graph capture).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
kit="$root/.e2e"
mkdir -p "$kit/wheels" "$kit/extra"
platforms=()
for p in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_26 \
         manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
  platforms+=(--platform "${p}_x86_64")
done
# Wheels installed by pip there (their metadata matters to importlib); the rest are unpacked.
extra_re='^(pydantic|pydantic_core|annotated_types|typing_inspection|jiter|httpx2|httpcore2|truststore)-'
names=$(sed -E 's/^([A-Za-z0-9_.]+)-([^-]+)-.*/\1==\2/' "$root/benchmarks/e2e/wheels.txt")
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --abi cp312 --abi abi3 --abi none "${platforms[@]}" -d "$kit/wheels" $names
site="$kit/site"; rm -rf "$site"; mkdir -p "$site"
for whl in "$kit/wheels"/*.whl; do
  if basename "$whl" | grep -Eq "$extra_re"; then cp "$whl" "$kit/extra/"; else unzip -qo "$whl" -d "$site"; fi
done
rm -f "$site"/sgl_kernel/flash_ops*.so "$site"/sgl_kernel/*/flash_ops*.so
rm -rf "$site"/sgl_kernel/sm100 "$site"/sgl_kernel/infllm_ops*.so "$site"/sgl_kernel/flashmla_ops*.so
find "$site" -name '*.a' -path '*xgrammar*' -delete
find "$site" -name '__pycache__' -prune -exec rm -rf {} +
# Two parts of about 36 MB each (each call carries one beside the working tree, 64 MiB in all): sglang's own
# tree, sgl_kernel, xgrammar and cuda-python in one, everything else in the other.
first=(sglang sgl_kernel xgrammar cuda)
(cd "$site" && tar -cJf "$kit/part1.tar.xz" "${first[@]}")
(cd "$site" && tar -cJf "$kit/part2.tar.xz" "${first[@]/#/--exclude=./}" .)
rm -f "$kit"/sglang_lora_tma_guard-*.whl
python3 -m pip wheel -q --no-deps -w "$kit" "$root"
du -sh "$kit"/part*.tar.xz "$kit/extra" "$kit"/sglang_lora_tma_guard-*.whl
