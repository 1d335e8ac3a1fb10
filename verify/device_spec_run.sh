#!/bin/sh
# Speculative decoding on the H200 (issue 16): device call 2 of 2, after verify/device_gates_stage.sh (call 1,
# which stashes the GGUF's part-aa). Installs the carried wheels, exposes this checkout as the package envex,
# joins the embedded GGUF (sha256 checked) and runs verify/kernel_bench/bench_spec.py: the 8B-shape verify-graph
# table and the embedded model's tok/s with n-gram speculation on and off. Extra arguments go to bench_spec.
# Writes $OUT/spec.json (its "markdown" field is the table for offline_docs/benchmarks.md) and $OUT/log.txt.
# When the GGUF cannot be joined (the machine went cold between the calls), runs the graphs section only and
# says so. Exit: bench_spec's status; 3 the setup failed; 4 the model section could not run.
set -u
cd "$(dirname "$0")/.."
out=${OUT:?OUT must name the folder for the results}
mkdir -p "$out"
limit=${ENVEX_DEVICE_TIMEOUT:-540}
site=${ENVEX_DEVICE_SITE:-/tmp/site}
ns=${ENVEX_DEVICE_NS:-/tmp/ns}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
  .whl/*.whl || { echo "spec: installing .whl/*.whl failed; carry .whl (devcarry prepare)" >&2; exit 3; }
mkdir -p "$ns/envex"
for d in kernels runtime verify bundles installer; do ln -sfn "$PWD/$d" "$ns/envex/$d"; done
export PYTHONPATH="$ns:$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
gguf=.device/model/SmolLM2-135M-Instruct.Q4_1.gguf
aa=.device/stash/part-aa
[ -f "$aa" ] || aa=.devcarry/gguf/part-aa
mkdir -p .device/model
rm -f "$gguf"
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
rcfile=$(mktemp)
if python3 -m envex.verify.devcarry join --manifest .devcarry/gguf/manifest.json --out "$gguf" \
    "$aa" .devcarry/gguf/part-ab 2>&1 | tee "$out/join.txt" && [ -f "$gguf" ]; then
  { timeout -k 10 "$limit" python3 -m envex.verify.kernel_bench.bench_spec --out "$out" --model "$gguf" \
      --commit "$commit" "$@" 2>&1; echo $? >"$rcfile"; } | tee "$out/log.txt"
  rc=$(cat "$rcfile")
else
  echo "!!! the GGUF could not be joined (machine cold between the calls?): graphs section only; re-run both calls" \
    | tee "$out/FALLBACK.txt"
  { timeout -k 10 "$limit" python3 -m envex.verify.kernel_bench.bench_spec --out "$out" --sections graphs \
      --commit "$commit" "$@" 2>&1; echo $? >"$rcfile"; } | tee "$out/log.txt"
  rc=4
fi
rm -f "$rcfile"
echo "spec: exit $rc; results in $out"
exit "$rc"
