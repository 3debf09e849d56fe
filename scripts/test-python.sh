#!/usr/bin/env bash
# The Python package's tests: builds and installs gpuio-py (`pip install ./gpuio-py`, maturin
# as the PEP 517 backend) into a virtualenv of its own with pinned test dependencies, then
# runs pytest. Installs python3-venv with apt-get where the machine lacks it (CI runs as root
# on a fresh Debian machine).
#
#   scripts/test-python.sh [pytest args...]
#   GPUIO_PY_VENV=DIR   the virtualenv (default: target/py-venv under the repository)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${GPUIO_PY_VENV:-$PWD/target/py-venv}
# Pinned: the versions the suite was written and last run against.
PINS=(maturin==1.16.0 pytest==9.2.0 numpy==2.4.6 safetensors==0.8.0)

apt_install() { # packages...
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
  else
    echo "test-python: $* missing and cannot be installed here (not root, or no apt-get)" >&2
    exit 1
  fi
}
command -v python3 >/dev/null || apt_install python3 python3-venv python3-pip
if [ ! -x "$VENV/bin/python" ]; then
  if ! python3 -m venv "$VENV" 2>/dev/null; then
    rm -rf "$VENV"
    echo "test-python: python3 -m venv failed; installing python3-venv" >&2
    apt_install python3-venv python3-pip
    python3 -m venv "$VENV"
  fi
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "${PINS[@]}"
# The README's install command, as a user runs it (a release build of the extension).
"$VENV/bin/python" -m pip install -q --force-reinstall --no-deps ./gpuio-py
# From the tests' directory's parent, so `gpuio` is the installed package, not the sources.
cd gpuio-py
"$VENV/bin/python" -c 'import gpuio; print("gpuio", gpuio.__version__, "from", gpuio.__file__)'
exec "$VENV/bin/python" -m pytest -rs tests "$@"
