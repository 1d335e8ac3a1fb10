"""The install media's layout (offline_docs/install.md), shared by `envex verify bundle` (which finds the media's
trust root from a bundle's path) and the installer (installer/media.py, which reads the media): `bundles/*.envex`,
`trust/root.json` (the newest root; older-to-newer rotation steps as `trust/root-<version>.json`), `install.sh`,
`offline_docs/`. Defined here because bundles imports none of the installer's packages.
"""

from __future__ import annotations

BUNDLES_DIR = "bundles"
TRUST_DIR = "trust"
ROOT_FILE = "root.json"
