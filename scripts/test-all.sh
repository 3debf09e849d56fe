#!/usr/bin/env bash
# The project's test command (README): the Rust workspace's tests first (`cargo test`: the
# library and the CLI, and any C API tests the workspace runs through cargo), then the Python
# package's (scripts/test-python.sh: builds gpuio-py into its own virtualenv, runs pytest).
#
#   scripts/test-all.sh [cargo test args...]
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== cargo test"
cargo test "$@"
echo "== Python (gpuio-py, pytest)"
bash scripts/test-python.sh
