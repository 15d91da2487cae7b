#!/usr/bin/env bash
# Set up a test environment from scratch and run the whole suite.
#   bash tests/run.sh [pytest args...]
# Installs torch first (pinned, CPU), then the project with its test extras under the same pin,
# then the Debian packages the tests need (libibverbs1 for Mooncake, chromium for the report test).
# The suite runs inside a private network namespace with only loopback, so the real servers the
# tests start (Mooncake, SeaweedFS) can reach nothing but 127.0.0.1. Without root (no namespace)
# those tests are deselected with a note, except under CI=true, where that is an error.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -c constraints.txt -e ".[test]"
# tests/test_images_env.py builds each image's Python environment from its requirements file, inside
# the network namespace below: fetch those wheels (and torch's) while the network is there.
export ARDIT_IMAGE_WHEELS="${ARDIT_IMAGE_WHEELS:-$HOME/.cache/ardit/image-wheels}"
.venv/bin/pip download -q -d "$ARDIT_IMAGE_WHEELS" torch==2.13.0
.venv/bin/pip download -q --no-deps -d "$ARDIT_IMAGE_WHEELS" -r images/requirements-gpu.txt -r images/requirements-tools.txt

need_apt=()
/sbin/ldconfig -p | grep -q libibverbs.so.1 || need_apt+=(libibverbs1)
command -v chromium >/dev/null || need_apt+=(chromium)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
  else
    echo "note: missing Debian packages ${need_apt[*]} (install as root); tests needing them will skip" >&2
  fi
fi

export PYTHONUNBUFFERED=1 MC_TCP_BIND_ADDRESS=127.0.0.1
if [ "$(id -u)" = 0 ] && unshare -n true 2>/dev/null; then
  # shellcheck disable=SC2016
  exec unshare -n bash -c 'ip link set lo up && exec .venv/bin/pytest "$@"' pytest -p no:cacheprovider "$@"
fi
if [ "${CI:-}" = true ]; then
  # CI must run the server tests (Mooncake, SeaweedFS): deselecting them quietly would pass a run
  # that never exercised the KV store or S3.
  echo "error: CI=true but no private network namespace is available (needs root and unshare):" \
       "the tests that start servers cannot run; run CI as root, or unset CI to skip them locally" >&2
  exit 2
fi
echo "note: no private network namespace available (needs root): skipping tests that start servers" \
     "(CI=true makes this an error)" >&2
exec .venv/bin/pytest -p no:cacheprovider -m "not servers" "$@"
