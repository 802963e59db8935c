#!/usr/bin/env python3
"""Prints the ninja targets that the named meson tests need, one per line, relative to the build directory: their
executables and the programs they start (meson's `depends`). With --libraries, also every library, custom target and
installed file (what a line builds besides its tests).
  scripts/test_targets.py BUILD_DIR rpc,rref,...|all [--libraries]"""
import json
import os
import subprocess
import sys

build, names = sys.argv[1], set(sys.argv[2].split(","))
libraries = "--libraries" in sys.argv[3:]
info = json.loads(subprocess.check_output(["meson", "introspect", "--targets", "--tests", build]))
by_id = {t["id"]: t for t in info["targets"]}
want = set()
if libraries:
    want = {t["id"] for t in info["targets"] if t["type"] in ("static library", "custom") or t.get("installed")}
for test in info["tests"]:
    if test["name"] in names or "all" in names:
        want.update(d for d in test["depends"] if d in by_id)
for i in sorted(want):
    for f in by_id[i]["filename"]:
        print(os.path.relpath(f, os.path.abspath(build)))
