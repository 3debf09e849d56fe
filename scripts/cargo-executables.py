#!/usr/bin/env python3
"""Reads `cargo ... --message-format=json` on stdin and prints "KIND-NAME<TAB>EXECUTABLE" for
each compiled test or bench target cargo reports (KIND: test, bench, lib, ...). Shared by the
bundle scripts (scripts/gpu-bundle.sh, scripts/agent-bundle.sh)."""
import json
import sys

for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m.get("profile", {}).get("test"):
        print(m["target"]["kind"][0] + "-" + m["target"]["name"] + "\t" + m["executable"])
