#!/usr/bin/env bash
# Runs tests/e2b/test_report.py: `clade bench --report` on the native test guest (needs
# /dev/kvm), the report's HTML and plots checked, rendered in Debian's chromium (screenshots
# in $CLADE_ARTIFACTS, default target/report-screenshots). Builds clade, makes a venv under
# build/venv if missing.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build -q -p clade
VENV=build/venv
if [ ! -x "$VENV/bin/pytest" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -c 'import selenium, pytest' 2>/dev/null ||
  "$VENV/bin/pip" install -q -r tests/e2b/requirements.txt pytest
CLADE="$PWD/target/debug/clade" CLADE_ARTIFACTS="${CLADE_ARTIFACTS:-$PWD/target/report-screenshots}" \
  "$VENV/bin/pytest" -q -s tests/e2b/test_report.py "$@"
