#!/usr/bin/env python3
"""Unpacks every wheel in WHEEL_DIR into SITE so that SITE on PYTHONPATH imports them, for a
machine with no network and nothing to install with (the GPU bundle's peers). A wheel's
``*.data/purelib`` and ``*.data/platlib`` trees are moved to the top, as an installer would.

    python3 unpack_wheels.py WHEEL_DIR SITE      # prints SITE, or nothing if no wheel
"""

import pathlib
import shutil
import sys
import zipfile


def main():
    wheels, site = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not found:
        return 0
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True)
    for w in found:
        with zipfile.ZipFile(w) as z:
            z.extractall(site)
    for data in site.glob("*.data"):
        for lib in ("purelib", "platlib"):
            for item in (data / lib).glob("*") if (data / lib).is_dir() else []:
                shutil.move(str(item), str(site / item.name))
        shutil.rmtree(data)
    # zipfile drops the mode bits: shared libraries and helper binaries keep working anyway
    # (dlopen needs no x bit), but scripts the loaders run would not.
    for f in site.rglob("*"):
        if f.is_file() and (f.suffix == ".so" or ".so." in f.name or f.parent.name == "bin"):
            f.chmod(0o755)
    print(site)
    return 0


if __name__ == "__main__":
    sys.exit(main())
