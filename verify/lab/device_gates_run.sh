#!/bin/sh
# Device call 2 of 2 (offline_docs/gates.md, "Running the gates on a GPU"): install the carried wheels, expose
# this checkout as the package envex, join the GGUF from the stashed part-aa and the carried part-ab (sha256
# checked against the manifest) and run verify/lab/cuda_check.py on it; extra arguments go to cuda_check. When the
# join fails (the machine went cold between the calls), run the random-weight check instead and say so loudly.
# Writes $OUT/summary.json, $OUT/gates.json, $OUT/log.txt, $OUT/join.txt. Exit: cuda_check's status (0 pass,
# 1 fail, 124 it ran past ENVEX_DEVICE_TIMEOUT seconds, default 540, inside the device's 600 s); 3 the setup
# failed; 4 the random-weight fallback ran.
set -u
cd "$(dirname "$0")/../.."
out=${OUT:?OUT must name the folder for the results}
mkdir -p "$out"
limit=${ENVEX_DEVICE_TIMEOUT:-540}
site=${ENVEX_DEVICE_SITE:-/tmp/site}
ns=${ENVEX_DEVICE_NS:-/tmp/ns}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
  .whl/*.whl || { echo "run: installing .whl/*.whl failed; carry .whl (devcarry prepare)" >&2; exit 3; }
# No envex/ folder exists (pyproject maps envex.<folder> onto the top-level folders): envex is a namespace package
# made of links to them.
mkdir -p "$ns/envex"
for d in kernels runtime verify bundles installer; do ln -sfn "$PWD/$d" "$ns/envex/$d"; done
export PYTHONPATH="$ns:$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
gguf=.device/model/SmolLM2-135M-Instruct.Q4_1.gguf
aa=.device/stash/part-aa
[ -f "$aa" ] || aa=.devcarry/gguf/part-aa
banner() {
  echo "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"
  echo "!!! FALLBACK: the GGUF could not be joined (machine cold between the calls?). RANDOM WEIGHTS: the gate"
  echo "!!! verdicts below only show the gates run on CUDA; they say nothing about the real model. Re-run both calls."
  echo "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"
}
rcfile=$(mktemp)
rm -f "$gguf"
if python3 -m envex.verify.lab.devcarry join --manifest .devcarry/gguf/manifest.json --out "$gguf" \
    "$aa" .devcarry/gguf/part-ab 2>&1 | tee "$out/join.txt" && [ -f "$gguf" ]; then
  { timeout -k 10 "$limit" python3 -m envex.verify.lab.cuda_check --model "$gguf" --out "$out" "$@" 2>&1
    echo $? >"$rcfile"; } | tee "$out/log.txt"
  rc=$(cat "$rcfile")
else
  banner | tee "$out/FALLBACK.txt"
  { timeout -k 10 "$limit" python3 -m envex.verify.lab.cuda_check --tok .devcarry/tok --out "$out" "$@" 2>&1
    echo $? >"$rcfile"; } | tee "$out/log.txt"
  banner
  rc=4
fi
rm -f "$rcfile"
if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
  echo "run: cuda_check was stopped after $limit s; the stages it finished are in $out/summary.json:"
  head -c 4000 "$out/summary.json" 2>/dev/null; echo
fi
echo "run: exit $rc; results in $out"
exit "$rc"
