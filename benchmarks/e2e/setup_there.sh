# shellcheck shell=bash
# Sourced on the GPU machine, from the repository root, with the kit of fetch_kit.sh carried in .e2e/
# (the kit is over one call's 64 MiB: carry part2 + extra in one call and part1 in the next, before the
# machine is released). Unpacks each part once into /tmp/e2e (kept while the machine stays up), installs
# this package's wheel, and puts the kit first on PYTHONPATH (SGLang 0.5.16 needs its transformers
# 5.12.1, not the machine's 5.17). Returns non-zero until both parts are in.
S=/tmp/e2e
mkdir -p "$S/site"
for part in part1 part2; do
  if [ -f ".e2e/$part.tar.xz" ] && [ ! -f "$S/.$part" ]; then
    { tar -xJf ".e2e/$part.tar.xz" -C "$S/site" && touch "$S/.$part"; } || return 1
  fi
done
if [ -d .e2e/extra ] && [ ! -f "$S/.extra" ]; then
  { python3 -m pip install -q --no-index --no-deps --no-compile --target "$S/extra" .e2e/extra/*.whl \
      && touch "$S/.extra"; } || return 1
fi
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target "$S/plugin" \
  .e2e/sglang_lora_tma_guard-*.whl || return 1
export PYTHONPATH="$S/plugin:$S/site:$S/extra" PYTHONUNBUFFERED=1 TRITON_CACHE_DIR="$S/triton" TVM_FFI_CACHE_DIR="$S/tvm"
export E2E="$S"
[ -f "$S/.part1" ] && [ -f "$S/.part2" ] && [ -f "$S/.extra" ]
