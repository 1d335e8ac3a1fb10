#!/usr/bin/env bash
# Wave-2 measurements on the 2-GPU host (issues 13, 15, 16, 17) in three back-to-back device calls, each from a
# `git archive` snapshot in .devcarry/head (carry .devcarry/head, .whl and the phase's GGUF part):
#
#   t  tensor parallelism on both GPUs (bench_tp: the 70B shape at TP=2 and the 8B shape at TP=1 and 2 through
#      the server, the share of a step in all-reduce); stashes the GGUF's part-aa in /tmp (carry
#      .devcarry/gguf/part-aa)
#   p  one GPU each, at once: GPU 0 the verify graphs with and without the multi-row GEMV, the multi-row GEMV
#      against cuBLAS per projection (bench_spec graphs, rows), then the deterministic mode's served cost
#      (bench_server det against default); GPU 1 gpt-oss-120b (bench_gpt_oss check32, profile, server)
#   q  join the GGUF (carry .devcarry/gguf/part-ab and manifest.json); GPU 0 the embedded model with n-gram
#      speculation in deterministic mode and with a draft model; GPU 1 the same in the default mode
#   r  what the first run left open: tensor parallelism on both GPUs with the all-reduce fix (the 70B shape at
#      TP=2, the 8B shape at TP=1 and 2, the share of a step in all-reduce), then gpt-oss's float32 check with
#      cuBLAS's TF32 override off (NVIDIA_TF32_OVERRIDE=0: does the GPU's KL 0.025 come from TF32?)
#
#   cd .devcarry/head && ln -sfn ../../.whl .whl && bash verify/lab/device_wave3.sh t
#
# Each job runs under its own time limit so that the phase ends inside the call's 600 s; results are packed into
# $OUT/<phase>.tgz and the phase's log is $OUT/<phase>.log.
set -u
phase=${1:?usage: device_wave3.sh t|p|q|r}
out=${OUT:?OUT must name the folder for the results}
cd "$(dirname "$0")/../.."
work=/tmp/wave3/$phase
mkdir -p "$work" /tmp/envex-stash /tmp/envex-model
log=$out/$phase.log
commit=$(cat COMMIT 2>/dev/null || echo unknown)
gguf=/tmp/envex-model/SmolLM2-135M-Instruct.Q4_1.gguf
t_start=$(date +%s)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log its exit status and seconds
  local name=$1 limit=$2 t0 rc
  shift 2
  t0=$(date +%s)
  echo "=== [$(($(date +%s) - t_start)) s] $name (limit $limit s, GPU ${CUDA_VISIBLE_DEVICES:-all}): $*"
  timeout -k 10 "$limit" "$@" >"$work/$name.log" 2>&1
  rc=$?
  tail -c 6000 "$work/$name.log"
  echo "=== $name: exit $rc after $(($(date +%s) - t0)) s"
}

{
  if [ "$phase" = t ]; then
    cp ../gguf/part-aa /tmp/envex-stash/part-aa.tmp && mv /tmp/envex-stash/part-aa.tmp /tmp/envex-stash/part-aa \
      && echo "part-aa stashed ($(wc -c </tmp/envex-stash/part-aa) bytes)"
  fi
  . ./verify/lab/device_setup.sh || exit 3
  nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total --format=csv,noheader
  case $phase in
    t)
      step tp "${ENVEX_TP_LIMIT:-540}" python3 -m envex.verify.lab.kernel_bench.bench_tp --out "$work/tp" \
        --commit "$commit" --sections "${ENVEX_TP_SECTIONS:-server70,server8,share}" \
        --deadline "$((${ENVEX_TP_LIMIT:-540} - 70))"
      ;;
    p)
      (
        export CUDA_VISIBLE_DEVICES=0
        step spec-graphs 110 python3 -m envex.verify.lab.kernel_bench.bench_spec --out "$work/spec" --sections graphs \
          --commit "$commit"
        step spec-rows 200 python3 -m envex.verify.lab.kernel_bench.bench_spec --out "$work/spec-rows" \
          --sections rows,graphs --gemv-rows 16 --commit "$commit"
        step server-det 250 python3 -m envex.verify.lab.kernel_bench.bench_server --out "$work/server" \
          --commit "$commit" --runs det:llama8b=/tmp/ns,def:llama8b=/tmp/ns --cases b1_1k,c64_1k \
          --engine def:enable_prefix_caching=true --engine det:deterministic=true,enable_prefix_caching=true
      ) >"$work/gpu0.txt" 2>&1 &
      (
        export CUDA_VISIBLE_DEVICES=1
        step gpt-oss "${ENVEX_GPT_OSS_LIMIT:-540}" python3 -m envex.verify.lab.kernel_bench.bench_gpt_oss \
          --out "$work/gpt-oss" --commit "$commit" --cases "${ENVEX_GPT_OSS_CASES:-b1_1k,c32_2k,b1_131k}" \
          --sections "${ENVEX_GPT_OSS_SECTIONS:-check32,profile,server}"
      ) >"$work/gpu1.txt" 2>&1 &
      wait
      cat "$work/gpu0.txt" "$work/gpu1.txt"
      ;;
    q)
      step join 30 python3 -m envex.verify.lab.devcarry join --manifest ../gguf/manifest.json --out "$gguf" \
        /tmp/envex-stash/part-aa ../gguf/part-ab
      (
        export CUDA_VISIBLE_DEVICES=0
        step spec-model-det 200 python3 -m envex.verify.lab.kernel_bench.bench_spec --out "$work/spec-det" \
          --sections model --model "$gguf" --commit "$commit" --deterministic
        step spec-draft-model 150 python3 -m envex.verify.lab.kernel_bench.bench_spec --out "$work/spec-draft" \
          --sections model --model "$gguf" --commit "$commit" --draft-model "$gguf" --workloads code-edit
      ) >"$work/gpu0.txt" 2>&1 &
      (
        export CUDA_VISIBLE_DEVICES=1
        step spec-model 200 python3 -m envex.verify.lab.kernel_bench.bench_spec --out "$work/spec" --sections model \
          --model "$gguf" --commit "$commit"
      ) >"$work/gpu1.txt" 2>&1 &
      wait
      cat "$work/gpu0.txt" "$work/gpu1.txt"
      ;;
    r)
      step tp 330 python3 -m envex.verify.lab.kernel_bench.bench_tp --out "$work/tp" --commit "$commit" \
        --sections server70,server8,share --deadline 270
      (
        export CUDA_VISIBLE_DEVICES=0 NVIDIA_TF32_OVERRIDE=0
        step gpt-oss-check32 200 python3 -m envex.verify.lab.kernel_bench.bench_gpt_oss --out "$work/gpt-oss" \
          --commit "$commit" --sections check32
      )
      ;;
    *) echo "unknown phase $phase (t, p, q or r)"; exit 2 ;;
  esac
  pkill -9 -f 'envex\.runtime\.(server|parallel\.workers)' 2>/dev/null
  tar czf "$out/$phase.tgz" -C /tmp/wave3 "$phase" 2>/dev/null
  echo "=== phase $phase done after $(($(date +%s) - t_start)) s; results in $phase.tgz"
} 2>&1 | tee "$log"
