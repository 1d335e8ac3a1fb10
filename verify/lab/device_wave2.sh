#!/usr/bin/env bash
# Wave-2 measurements on one H200 (issues 13, 16, 17) in back-to-back device calls, each from a `git archive`
# snapshot in .devcarry/head (carry .devcarry/head, .whl and the phase's GGUF part; run from the repo root):
#
#   a  stash the GGUF's part-aa in /tmp (carry .devcarry/gguf/part-aa); the speculative verify-graph table
#      (bench_spec graphs); the deterministic mode's served cost and served invariance (bench_server,
#      deterministic against default, both with the prefix cache on: b1_1k, c64_1k, inv)
#   b  join the embedded GGUF from a's part-aa and the carried part-ab (carry .devcarry/gguf/part-ab and
#      .devcarry/gguf/manifest.json; the machine must still be warm from a); bench_spec's embedded-model section;
#      the full suite's batch_invariance gate on the GPU in deterministic mode; the deterministic kernels row
#      against row at the 8B shapes (bench_invariance)
#   c  gpt-oss-120b (bench_gpt_oss: check, profile, server)
#   d  the verify graphs again (bench_spec graphs), the
#      deterministic kernels again (bench_invariance); on a host of two GPUs, tensor parallelism (bench_tp). Run after `sh verify/lab/device_install.sh stage` (same call)
#   e  the embedded model with n-gram speculation, default and deterministic mode, and drafting with a draft model
#      (itself). Run after `sh verify/lab/device_install.sh run` (an earlier call; it joins the GGUF into .device/model)
#
#   cd .devcarry/head && bash verify/lab/device_wave2.sh a
#
# Each step runs under its own time limit so that the phase ends inside the call's 600 s; what it wrote is packed
# into $OUT/<phase>.tgz (results, logs) and the phase's log is $OUT/<phase>.log.
set -u
phase=${1:?usage: device_wave2.sh a|b|c|d|e}
out=${OUT:?OUT must name the folder for the results}
cd "$(dirname "$0")/../.."
work=/tmp/wave2/$phase
mkdir -p "$work" /tmp/envex-stash /tmp/envex-model
log=$out/$phase.log
commit=$(cat COMMIT 2>/dev/null || echo unknown)
gguf=/tmp/envex-model/SmolLM2-135M-Instruct.Q4_1.gguf
t_start=$(date +%s)

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log its exit status and seconds
  local name=$1 limit=$2 t0 rc
  shift 2
  t0=$(date +%s)
  echo "=== [$(($(date +%s) - t_start)) s] $name (limit $limit s): $*"
  timeout -k 10 "$limit" "$@" 2>&1
  rc=$?
  # A bench stopped at its limit cannot reap the servers and ranks it started in sessions of their own; on the
  # 2-GPU host a 70B server left holding both GPUs made the next call's KV cache sizing fail.
  pkill -9 -f 'envex\.runtime\.(server|parallel\.workers)' 2>/dev/null && sleep 2
  echo "=== $name: exit $rc after $(($(date +%s) - t0)) s"
}

pack() {
  tar czf "$out/$phase.tgz" -C /tmp/wave2 "$phase" 2>/dev/null
  echo "=== phase $phase done after $(($(date +%s) - t_start)) s; results in $phase.tgz"
}

{
  if [ "$phase" = a ]; then
    cp ../gguf/part-aa /tmp/envex-stash/part-aa.tmp && mv /tmp/envex-stash/part-aa.tmp /tmp/envex-stash/part-aa \
      && echo "part-aa stashed ($(wc -c </tmp/envex-stash/part-aa) bytes)"
  fi
  . ./verify/lab/device_setup.sh || exit 3
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  case $phase in
    a)
      step spec-graphs 110 python3 -m envex.verify.lab.kernel_bench.bench_spec --out "$work/spec" --sections graphs \
        --commit "$commit"
      step server-det 330 python3 -m envex.verify.lab.kernel_bench.bench_server --out "$work/server" \
        --commit "$commit" \
        --runs det:llama8b=/tmp/ns,def:llama8b=/tmp/ns --cases b1_1k,c64_1k,inv \
        --engine def:enable_prefix_caching=true --engine det:deterministic=true,enable_prefix_caching=true
      ;;
    b)
      step join 30 python3 -m envex.verify.lab.devcarry join --manifest ../gguf/manifest.json --out "$gguf" \
        /tmp/envex-stash/part-aa ../gguf/part-ab
      step spec-model 170 python3 -m envex.verify.lab.kernel_bench.bench_spec --out "$work/spec" --sections model \
        --model "$gguf" --commit "$commit"
      step gates-det-invariance 150 python3 -m envex.verify.lab.cuda_check --model "$gguf" --suite full \
        --gates batch_invariance --out "$work/gates-det-full-invariance" --deterministic
      step invariance-kernels 100 python3 -m envex.verify.lab.kernel_bench.bench_invariance --out "$work/inv" \
        --commit "$commit"
      ;;
    d)  # after `sh verify/lab/device_install.sh stage` in the same call (it stashes part-aa in .device/stash)
      step spec-rows-graphs 150 python3 -m envex.verify.lab.kernel_bench.bench_spec --out "$work/spec" \
        --sections graphs --commit "$commit"
      step invariance-kernels 60 python3 -m envex.verify.lab.kernel_bench.bench_invariance --out "$work/inv" \
        --commit "$commit"
      if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
        tp_limit=${ENVEX_TP_LIMIT:-300}
        step tp "$tp_limit" python3 -m envex.verify.lab.kernel_bench.bench_tp --out "$work/tp" --commit "$commit" \
          --deadline "$((tp_limit - 60))"
      fi
      ;;
    e)  # after `sh verify/lab/device_install.sh run` (an earlier call on this warm machine joined the GGUF)
      gguf=$PWD/.device/model/SmolLM2-135M-Instruct.Q4_1.gguf
      step spec-model 110 python3 -m envex.verify.lab.kernel_bench.bench_spec --out "$work/spec" --sections model \
        --model "$gguf" --commit "$commit"
      step spec-model-det 110 python3 -m envex.verify.lab.kernel_bench.bench_spec --out "$work/spec-det" \
        --sections model --model "$gguf" --commit "$commit" --deterministic
      step spec-draft-model 80 python3 -m envex.verify.lab.kernel_bench.bench_spec --out "$work/spec-draft" \
        --sections model --model "$gguf" --commit "$commit" --draft-model "$gguf" --workloads code-edit
      ;;
    c)
      step gpt-oss "${ENVEX_GPT_OSS_LIMIT:-530}" python3 -m envex.verify.lab.kernel_bench.bench_gpt_oss \
        --out "$work/gpt-oss" --commit "$commit" --cases "${ENVEX_GPT_OSS_CASES:-b1_1k,c32_2k,b1_131k}" \
        --sections "${ENVEX_GPT_OSS_SECTIONS:-check,profile,server}"
      ;;
    *) echo "unknown phase $phase (a to e)"; exit 2 ;;
  esac
  pack
} 2>&1 | tee "$log"
