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

# One line before each step, so a long one (pip with a full wheelhouse takes minutes) is never silent.
say() {
    printf 'install.sh: %s\n' "$*"
}

if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "error: $PYTHON not found; install python3 >= 3.11 or set PYTHON=/path/to/python3" >&2
    exit 2
fi
if ! "$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
    echo "error: $("$PYTHON" --version 2>&1) is too old; envex needs python >= 3.11 (set PYTHON=...)" >&2
    exit 2
fi

say "$("$PYTHON" --version 2>&1) ($PYTHON); media $MEDIA"

BOOT=$(mktemp -d "${TMPDIR:-/tmp}/envex-bootstrap.XXXXXX")
trap 'rm -rf "$BOOT"' EXIT INT TERM

# Unpack the newest runtime bundle's wheelhouse and card (tarfile's "data" filter refuses links and odd paths).
say "[1/4] unpacking the newest runtime bundle in $MEDIA/bundles"
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
print(card["wheelhouse"], bundles[-1].name)
PY
)
BUNDLE=${MODE#* }
MODE=${MODE%% *}
WHEELS="$BOOT/runtime/wheelhouse"
COUNT=$(find "$WHEELS" -maxdepth 1 -name '*.whl' | wc -l | tr -d ' ')
if [ "$COUNT" = 1 ]; then WHEEL_S="1 wheel"; else WHEEL_S="$COUNT wheels"; fi
say "      $BUNDLE: $WHEEL_S, $MODE wheelhouse"

say "[2/4] creating a temporary venv with $PYTHON -m venv"
"$PYTHON" -m venv "$BOOT/venv"
# pip without -q: its own lines (and, where its version has one, its install progress bar) show it working.
# --no-compile: this venv is thrown away after one run, and pip byte-compiling a full wheelhouse's ~12,000 modules
# took 4x as long as installing them (130 s against 29 s on 2 cores, torch 2.13 CPU); Python compiles the few
# hundred envex-install imports, as it imports them. (The release venv is compiled: envex-install's own pip.)
if [ "$MODE" = "complete" ]; then
    say "[3/4] installing envex and its dependencies from the $WHEEL_S (pip --no-index: nothing is downloaded);" \
        "a full wheelhouse takes a minute or two"
    "$BOOT/venv/bin/python" -m pip install --isolated --no-index --no-cache-dir --disable-pip-version-check --no-compile \
        --find-links "$WHEELS" envex
else
    # Demo wheelhouse: envex only; its dependencies come from $PYTHON's own environment, offline.
    say "[3/4] installing the $WHEEL_S of the demo wheelhouse (pip --no-index: nothing is downloaded);" \
        "envex's dependencies come from $PYTHON's environment"
    "$PYTHON" -c 'import site, sys; print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))' \
        > "$("$BOOT/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_envex_demo_deps.pth"
    "$BOOT/venv/bin/python" -m pip install --isolated --no-index --no-cache-dir --disable-pip-version-check \
        --no-compile --no-deps --ignore-installed "$WHEELS"/*.whl
    # A plain python3 lacks them: name what is missing in one line, not envex-install's ModuleNotFoundError.
    MISSING=$("$BOOT/venv/bin/python" - <<'PY'
import re
from importlib.metadata import PackageNotFoundError, distribution, version
missing = []
for req in distribution("envex").requires or []:
    spec, _, marker = req.partition(";")
    if "extra" in marker:
        continue
    try:
        version(re.match(r"[A-Za-z0-9._-]+", spec.strip()).group(0))
    except PackageNotFoundError:
        missing.append(spec.strip().replace(" ", ""))
print(" ".join(missing))
PY
)
    if [ -n "$MISSING" ]; then
        echo "error: $PYTHON lacks envex's dependencies $MISSING (demo media carry the envex wheel only and take" \
            "the rest from the python that runs install.sh): run it with PYTHON=/path/to/a/python3 that has them," \
            "or install them into $PYTHON's environment, or use media with a complete wheelhouse" >&2
        exit 2
    fi
fi

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 DO_NOT_TRACK=1
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
say "[4/4] running envex-install: it verifies every bundle on the media before anything is installed"
set +e
"$BOOT/venv/bin/envex-install" --media "$MEDIA" "$@"
STATUS=$?
exit $STATUS
