# Sourced on the GPU machine, from the repository root, with the kit of fetch_kit.sh carried in .e2e/:
# unpack it once into /tmp/e2e (kept while the machine stays up), install this package's wheel, and
# put the kit first on PYTHONPATH (SGLang 0.5.16 needs its transformers 5.12.1, not the machine's 5.17).
S=/tmp/e2e
if [ ! -f $S/.ready ]; then
  mkdir -p $S/site
  tar -xJf .e2e/part1.tar.xz -C $S/site && tar -xJf .e2e/part2.tar.xz -C $S/site || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --target $S/extra .e2e/extra/*.whl || return 1
  touch $S/.ready
fi
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target $S/plugin .e2e/sglang_lora_tma_guard-*.whl || return 1
export PYTHONPATH=$S/plugin:$S/site:$S/extra PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$S/triton TVM_FFI_CACHE_DIR=$S/tvm
export E2E=$S
