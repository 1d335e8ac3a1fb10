# Sourced by a device command from the root of a snapshot of the repo (`. verify/lab/device_setup.sh`): installs
# the carried wheels (.whl: the server's packages the device image lacks) into /tmp/site and exposes this tree as
# the namespace package envex in /tmp/ns (there is no envex/ folder: pyproject maps envex.<folder> onto the
# top-level folders; the lab, verify/lab, comes with verify as envex.verify.lab).
[ -f pyproject.toml ] && [ -f verify/lab/device_setup.sh ] \
  || { echo "device_setup: source it from the repo root (. verify/lab/device_setup.sh), not from $PWD" >&2; return 3; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "device_setup: installing .whl/*.whl failed; carry .whl" >&2; return 3; }
mkdir -p /tmp/ns/envex
for d in kernels runtime verify bundles installer tests offline_docs; do ln -sfn "$PWD/$d" "/tmp/ns/envex/$d"; done
export PYTHONPATH="/tmp/ns:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
