#!/bin/sh
# Envex bootstrap, run from the install media on a machine with nothing but python3 >= 3.11:
#   sh /media/usb/install.sh --prefix /opt/envex [--trust-fingerprint FP] [other envex-install options]
# It unpacks the runtime bundle's wheelhouse into a temporary venv (pip --no-index: nothing is downloaded) and
# runs envex-install from it, which verifies every bundle on the media, this runtime bundle included, against
# the trust root whose fingerprint you confirm, before anything is installed or activated.
# PYTHON=/path/to/python3 picks the interpreter. See offline_docs/install.md.
set -eu

MEDIA=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-python3}

if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "error: $PYTHON not found; install python3 >= 3.11 or set PYTHON=/path/to/python3" >&2
    exit 2
fi
if ! "$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
    echo "error: $("$PYTHON" --version 2>&1) is too old; envex needs python >= 3.11 (set PYTHON=...)" >&2
    exit 2
fi

BOOT=$(mktemp -d "${TMPDIR:-/tmp}/envex-bootstrap.XXXXXX")
trap 'rm -rf "$BOOT"' EXIT INT TERM

# Unpack the newest runtime bundle's wheelhouse and card (tarfile's "data" filter refuses links and odd paths).
MODE=$("$PYTHON" - "$MEDIA" "$BOOT" <<'PY'
import json, re, sys, tarfile
from pathlib import Path
media, boot = Path(sys.argv[1]), Path(sys.argv[2])
def key(p):
    m = re.search(r"-(\d+)\.(\d+)\.(\d+)", p.name)
    return tuple(int(x) for x in m.groups()) if m else (0, 0, 0)
bundles = sorted((media / "bundles").glob("envex-runtime-*.envex"), key=key)
if not bundles:
    sys.exit(f"error: {media}/bundles holds no envex-runtime-*.envex; is this the install media?")
with tarfile.open(bundles[-1]) as tar:
    members = [m for m in tar.getmembers() if m.isfile() and m.name.startswith("payload/")]
    for m in members:
        m.name = m.name[len("payload/"):]
    tar.extractall(boot / "runtime", members=members, filter="data")
card = json.loads((boot / "runtime" / "envex-runtime.json").read_text())
print(card["wheelhouse"])
PY
)

"$PYTHON" -m venv "$BOOT/venv"
WHEELS="$BOOT/runtime/wheelhouse"
if [ "$MODE" = "complete" ]; then
    "$BOOT/venv/bin/python" -m pip install --isolated --no-index --no-cache-dir --disable-pip-version-check -q \
        --find-links "$WHEELS" envex
else
    # Demo wheelhouse: envex only; its dependencies come from $PYTHON's own environment, offline.
    "$PYTHON" -c 'import site, sys; print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))' \
        > "$("$BOOT/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_envex_demo_deps.pth"
    "$BOOT/venv/bin/python" -m pip install --isolated --no-index --no-cache-dir --disable-pip-version-check -q \
        --no-deps --ignore-installed "$WHEELS"/*.whl
fi

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 DO_NOT_TRACK=1
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
set +e
"$BOOT/venv/bin/envex-install" --media "$MEDIA" "$@"
STATUS=$?
exit $STATUS
