#!/usr/bin/env bash
# The package as users get it: build the wheel, list what it ships (the package and its data, nothing of
# the tests' harness or the benchmarks), install it (not editable) into a fresh virtual
# environment, and check there that SGLang's plugin group resolves `lora_tma_guard` to a callable and
# that `python -m sglang_lora_tma_guard.check --json` runs and exits with the code its verdict names
# (1, exposed: SGLang 0.5.16 without the switch; 0, protected: with it).
# SGLang and its import chain come from the test environment's site-packages, linked in one by one
# without this package's own editable install, so the wheel is the only copy of the package there.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup.sh"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# Built from a copy of what git would ship (tracked and untracked-not-ignored files): a build/ left in the
# checkout by an older build must not put files of its own into the wheel.
mkdir "$work/src"
(cd "$root" && git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$work/src")
"$PY" -m pip wheel -q --no-deps -w "$work/dist" "$work/src" 2> "$work/build.log" || { cat "$work/build.log" >&2; exit 1; }
"$PY" - "$work"/dist/sglang_lora_tma_guard-*.whl <<'PY'
import sys, zipfile
names = sorted(n for n in zipfile.ZipFile(sys.argv[1]).namelist() if not n.endswith("/"))
package = [n for n in names if n.startswith("sglang_lora_tma_guard/")]
print(f"wheel: {len(package)} files of the package: " + " ".join(n.split("/", 1)[1] for n in package))
assert "sglang_lora_tma_guard/py.typed" in names and "sglang_lora_tma_guard/lora_moe_tiles.json" in names
stray = [n for n in names if not n.startswith(("sglang_lora_tma_guard/", "sglang_lora_tma_guard-"))]
assert not stray, f"the wheel ships more than the package: {stray}"
PY
python3 -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --no-deps --no-index "$work"/dist/sglang_lora_tma_guard-*.whl
site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
mkdir "$work/deps"
for entry in "$site"/*; do
  case "$(basename "$entry")" in
    sglang_lora_tma_guard*|__editable__*|_sglang_lora_tma_guard*) ;;
    *) ln -s "$entry" "$work/deps/" ;;
  esac
done
cd "$work"
export PYTHONPATH="$work/deps" TRITON_INTERPRET=1
"$work/venv/bin/python" - <<'PY'
import sglang_lora_tma_guard, sys
from importlib import metadata
[ep] = [ep for ep in metadata.entry_points(group="sglang.srt.plugins") if ep.name == "lora_tma_guard"]
assert callable(ep.load()), ep
where = sglang_lora_tma_guard.__file__
assert "/venv/" in where and "site-packages" in where, f"not the wheel's copy: {where}"
from sglang_lora_tma_guard import tuning
assert tuning._table(None).get("NVIDIA H200"), "the tuned LoRA MoE tiles are not in the wheel"
print(f"wheel: {ep.name} = {ep.value} -> {where} (with the tuned LoRA MoE tiles)")
PY
for switch in 0 1; do
  set +e
  SGLANG_LORA_TMA_GUARD=$switch "$work/venv/bin/python" -m sglang_lora_tma_guard.check --json > "check-$switch.json" 2> check.err
  code=$?
  set -e
  "$work/venv/bin/python" - "$switch" "$code" <<'PY'
import json, sys
switch, code = sys.argv[1], int(sys.argv[2])
report = json.load(open(f"check-{switch}.json"))
expected = {"0": ("exposed", 1), "1": ("protected", 0)}[switch]
got = (report["verdict"]["status"], code)
assert got == expected and report["verdict"]["exit_code"] == code, (got, expected, report["verdict"])
print(f"wheel: check with SGLANG_LORA_TMA_GUARD={switch}: {got[0]}, exit {code}")
PY
done
