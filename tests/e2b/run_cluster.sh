#!/usr/bin/env bash
# Runs tests/e2b/test_cluster.py: a cluster of `clade serve --cluster` nodes on this
# machine (each in its own network namespace; PostgreSQL from Debian's postgresql-15 as
# user postgres; the tests' S3 server) with native test-guest VMs. Needs root and
# /dev/kvm. Builds clade and the S3 server, makes a venv under build/venv if missing.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build -q -p clade
[ -x build/tools/bin/clade-test-s3 ] || ./scripts/setup.sh
(cd tests/native-guest && env -u RUSTFLAGS -u CARGO_ENCODED_RUSTFLAGS \
    CARGO_TARGET_DIR="$PWD/../../target/native-guest" cargo build --release --quiet)
VENV=build/venv
if [ ! -x "$VENV/bin/pytest" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q -r tests/e2b/requirements.txt pytest
fi
"$VENV/bin/python" -c 'import yaml, hcl2' 2>/dev/null ||
  "$VENV/bin/pip" install -q -r tests/e2b/requirements.txt
# The deployment files too (deploy/: offline, parsed and checked against clade's flags).
CLADE="$PWD/target/debug/clade" "$VENV/bin/pytest" -q -s tests/deploy/test_manifests.py \
  tests/e2b/test_cluster.py tests/e2b/test_cluster_tls.py "$@"
