#!/usr/bin/env bash
# Runs tests/e2b/test_dataplane.py: the pinned e2b SDK against `clade serve` in its
# TEST HARNESS mode (--test-host-agent: sandboxes are host-run clade-agent processes, not
# VMs). Builds clade and clade-agent, makes a venv under build/venv if missing.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build -q -p clade -p guest-agent
VENV=build/venv
if [ ! -x "$VENV/bin/pytest" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q -r tests/e2b/requirements.txt pytest
fi
# The service's state directory is private to it (0700); the tests' scratch directory is
# beside it, reachable by another user (test_files_as_another_user).
RUN=$(mktemp -d)
chmod 755 "$RUN"
STATE="$RUN/state"
mkdir "$STATE"
PORT=${CLADE_DP_PORT:-39417}
export CLADE_DP_SCRATCH="$RUN/scratch"
CLADE_API_KEY=dp-test target/debug/clade serve --listen 127.0.0.1:$PORT --state-dir "$STATE" \
  --test-host-agent target/debug/clade-agent >"$STATE/serve.log" 2>&1 &
SERVE=$!
# A second service over HTTPS (test_https_domain_and_get_host): --domain with a wildcard
# certificate signed by a CA this run makes (it also names 127.0.0.1, where the SDK's own
# clients reach the API: they resolve names with a DNS client of their own); the test
# resolves names under the domain to this host itself, and the SDK's clients trust only that
# CA (SSL_CERT_FILE: this suite reaches nothing else over TLS).
TLS_DOMAIN=sandboxes.clade.test
TLS_PORT=${CLADE_DP_TLS_PORT:-39419}
TLS="$STATE/tls"
mkdir -p "$TLS"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
  -subj "/CN=clade test CA" -keyout "$TLS/ca.key" -out "$TLS/ca.pem" 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=*.$TLS_DOMAIN" \
  -keyout "$TLS/key.pem" -out "$TLS/req.csr" 2>/dev/null
printf 'subjectAltName=DNS:*.%s,DNS:%s,IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n' \
  "$TLS_DOMAIN" "$TLS_DOMAIN" >"$TLS/ext.cnf"
openssl x509 -req -in "$TLS/req.csr" -CA "$TLS/ca.pem" -CAkey "$TLS/ca.key" -CAcreateserial \
  -days 2 -extfile "$TLS/ext.cnf" -out "$TLS/cert.pem" 2>/dev/null
CLADE_API_KEY=dp-test target/debug/clade serve --listen 127.0.0.1:$TLS_PORT --state-dir "$STATE/tls-state" \
  --domain "$TLS_DOMAIN" --tls-cert "$TLS/cert.pem" --tls-key "$TLS/key.pem" \
  --test-host-agent target/debug/clade-agent >"$STATE/serve-tls.log" 2>&1 &
SERVE_TLS=$!
trap 'kill $SERVE $SERVE_TLS 2>/dev/null; wait $SERVE $SERVE_TLS 2>/dev/null; rm -rf "$RUN"' EXIT
for _ in $(seq 50); do grep -q listening "$STATE/serve.log" && grep -q listening "$STATE/serve-tls.log" && break; sleep 0.1; done
E2B_API_URL=http://127.0.0.1:$PORT E2B_SANDBOX_URL=http://127.0.0.1:$PORT E2B_API_KEY=dp-test \
  CLADE_TLS_DOMAIN=$TLS_DOMAIN CLADE_TLS_PORT=$TLS_PORT CLADE_TLS_CA="$TLS/ca.pem" SSL_CERT_FILE="$TLS/ca.pem" \
  "$VENV/bin/pytest" -q tests/e2b/test_dataplane.py "$@" ||
  { tail -30 "$STATE/serve.log"; tail -10 "$STATE/serve-tls.log"; exit 1; }
