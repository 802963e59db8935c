#!/usr/bin/env python3
"""Prints what each failed test of one or more meson test logs said where it failed, so that a long CI run's last
lines carry the reason of a failure and not only its name (a CI's report may keep only the tail of the output).

    scripts/failed_tests.py BUILD/meson-logs/testlog.json [...] [--lines N]

For each test that neither passed nor was skipped: its name, result and time, then its output from a few lines before
the first failure doctest, a sanitizer or the C++ runtime reported (doctest's "ERROR:", "FATAL ERROR", a sanitizer's
"ERROR: …Sanitizer", "terminate called"; stdout before stderr), at most N lines (default 80); the output's last N
lines where none shows.
Prints nothing when everything passed.
"""
import argparse
import json
import re
import sys

# Case-sensitive: the runtime's own log lines ("corpc error [...]") are expected in many passing cases.
MARK = re.compile(r"ERROR:|FATAL ERROR|Sanitizer|terminate called|Assertion .* failed")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def excerpt(streams, lines):
    """From the first stream that shows a failure, the lines around it; else the last lines of both."""
    every = []
    for text in streams:
        rows = ANSI.sub("", text or "").splitlines()
        for i, row in enumerate(rows):
            if MARK.search(row):
                start = max(0, i - 8)
                return rows[start:start + lines]
        every += rows
    return every[-lines:]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("logs", nargs="+")
    parser.add_argument("--lines", type=int, default=80)
    args = parser.parse_args()
    for path in args.logs:
        try:
            entries = [json.loads(line) for line in open(path)]
        except OSError as e:
            print(f"failed tests: cannot read {path}: {e}")
            continue
        for test in entries:
            if test["result"] in ("OK", "SKIP", "EXPECTEDFAIL"):
                continue
            print(f"--- {test['name']}: {test['result']} after {test.get('duration', 0):.1f} s ({path})")
            for row in excerpt([test.get("stdout"), test.get("stderr")], args.lines):
                print("    " + row)


if __name__ == "__main__":
    sys.exit(main())
