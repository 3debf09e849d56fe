"""Shared fixtures. Tests that cannot run here skip with the reason printed (run pytest with
``-rs`` to see them listed at the end, as scripts/test-all.sh does)."""

import os
import sys
import tempfile

import pytest

import gpuio


def skip_loudly(reason):
    """Skips the calling test, printing why on stderr as well as in pytest's summary."""
    print(f"SKIPPED: {reason}", file=sys.stderr)
    pytest.skip(reason)


def pattern(n, seed=0):
    """``n`` reproducible bytes that differ at every position a read could misplace."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=n, dtype=np.uint8).tobytes()


@pytest.fixture(scope="session")
def engine():
    return gpuio.Engine()


@pytest.fixture
def tmpdir_path():
    # GPUIO_TEST_DIR: a directory on the disk under test (the GPU bundle sets it).
    base = os.environ.get("GPUIO_TEST_DIR")
    if base:
        os.makedirs(base, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=base) as d:
        yield d


@pytest.fixture
def data_file(tmpdir_path):
    """A 9 MiB + 123 byte file of pattern bytes: (path, contents)."""
    data = pattern((9 << 20) + 123, seed=1)
    path = os.path.join(tmpdir_path, "data.bin")
    with open(path, "wb") as f:
        f.write(data)
    return path, data
