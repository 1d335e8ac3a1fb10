#!/bin/sh
# Device call 1 of 2 (offline_docs/gates.md, "Running the gates on a GPU"). One call moves at most 64 MiB and the
# embedded GGUF is 94 MiB, so call 1 carries part-aa and keeps it in .device/stash: .device/ is in .gitignore, and
# ignored files in the repo root stay on a warm machine until the next call. Call 2 (device_gates_run.sh) must
# follow before the machine is given back (it stays warm about 30 s after a call).
set -eu
cd "$(dirname "$0")/../.."
stash=.device/stash
src=.devcarry/gguf
[ -f "$src/part-aa" ] || {
  echo "stage: $src/part-aa is missing; run 'python -m envex.verify.lab.devcarry prepare' here and carry it" >&2
  exit 3
}
mkdir -p "$stash"
cp "$src/part-aa" "$stash/part-aa.tmp" && mv "$stash/part-aa.tmp" "$stash/part-aa"
[ -f "$src/manifest.json" ] && cp "$src/manifest.json" "$stash/manifest.json"
sha256sum "$stash/part-aa"
echo "stage: part-aa stashed in $PWD/$stash ($(wc -c <"$stash/part-aa") bytes); start call 2 now"
