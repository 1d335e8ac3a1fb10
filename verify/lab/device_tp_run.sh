#!/bin/sh
# Tensor parallelism on the 2-GPU host (issue 15), one device call: installs the carried wheels and exposes this
# checkout as the package envex (verify/lab/device_setup.sh), switches NVLink multicast off for every process it
# starts, and runs verify/lab/kernel_bench/bench_tp.py (all-reduce microbench, share of a step in all-reduce, the
# 70B and 8B shapes through the server). Extra arguments go to bench_tp. Writes $OUT/tp.json (its "markdown"
# field is the table for verify/lab/journal.md), $OUT/log.txt and the servers' logs.
# Exit: bench_tp's status (124: it ran past ENVEX_DEVICE_TIMEOUT, default 530 s); 3 the setup failed.
set -u
cd "$(dirname "$0")/../.."
out=${OUT:?OUT must name the folder for the results}
mkdir -p "$out"
limit=${ENVEX_DEVICE_TIMEOUT:-530}
. ./verify/lab/device_setup.sh || exit 3
# Also set by envex itself (runtime/parallel/state.py NO_MULTICAST_ENV) before it starts NCCL or its workers.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv | tee "$out/gpus.txt"
nvidia-smi topo -m >"$out/topo.txt" 2>&1
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
rcfile=$(mktemp)
{ timeout -k 10 "$limit" python3 -m envex.verify.lab.kernel_bench.bench_tp --out "$out" --tree /tmp/ns \
    --commit "$commit" --deadline $((limit - 110)) "$@" 2>&1; echo $? >"$rcfile"; } | tee "$out/log.txt"
rc=$(cat "$rcfile")
rm -f "$rcfile"
echo "tp: exit $rc; results in $out"
exit "$rc"
