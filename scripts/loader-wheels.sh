#!/usr/bin/env bash
# The checkpoint loaders gpuio is compared with (issue 20's cold and warm checkpoint rows), as
# wheels for a GPU machine that has torch but no network: Run:ai's model streamer,
# fastsafetensors and InstantTensor, at the versions measured in BENCHMARKS.md, plus the pure
# Python packages they import that such a machine may lack. torch and numpy are not carried:
# the machine's own are used (the loaders load their CUDA libraries at run time).
#
#   scripts/loader-wheels.sh DIR        # downloads the wheels into DIR
#
# On the GPU machine, `python3 -m zipfile -e` each wheel into one directory and put it on
# PYTHONPATH after gpuio's (the bundle's run.sh and datapath.sh do). Needs pip and PyPI.
set -euo pipefail
DIR=${1:?usage: scripts/loader-wheels.sh DIR}
PY=${GPUIO_LOADER_PY:-3.12}
# One pinned version each, so that a table names what it measured.
LOADERS=(
  "runai-model-streamer==${GPUIO_RUNAI_VERSION:-0.17.0}"
  "fastsafetensors==${GPUIO_FASTSAFETENSORS_VERSION:-0.5.0}"
  "instanttensor==${GPUIO_INSTANTTENSOR_VERSION:-0.2.2}"
  # Imported by Run:ai's streamer; pure Python.
  "humanize==4.12.3"
)
pip=$(command -v pip || command -v pip3) || { echo "loader-wheels.sh: pip is needed" >&2; exit 1; }
mkdir -p "$DIR"
"$pip" download -q --no-deps --only-binary=:all: --python-version "$PY" \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_30_x86_64 \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$DIR" "${LOADERS[@]}"
ls "$DIR"
