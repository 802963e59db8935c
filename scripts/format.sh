#!/usr/bin/env bash
# Checks that every C++ file is laid out as .clang-format says (clang-format 14, Debian 12's: other versions lay some
# constructs out differently, so the check runs with that one). Prints "format: N passed, N failed" and the files
# that differ, with the command that fixes them; exits non-zero if any does.
#   scripts/format.sh          check
#   scripts/format.sh --fix    rewrite the files that differ
set -euo pipefail
cd "$(dirname "$0")/.."
tool=clang-format-14
command -v "$tool" >/dev/null || { echo "format: 0 passed, 1 failed ($tool is not installed: scripts/setup.sh)"; exit 1; }
mapfile -t files < <(git ls-files '*.hpp' '*.cpp' '*.h' '*.cu')
if [[ ${1:-} == --fix ]]; then
  "$tool" -i "${files[@]}"
  echo "format: rewrote what differed in ${#files[@]} files"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  "$tool" --dry-run --Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if ((${#bad[@]})); then
  printf '  %s\n' "${bad[@]}"
  echo "format: these files differ from .clang-format; fix them with scripts/format.sh --fix"
fi
echo "format: $((${#files[@]} - ${#bad[@]})) passed, ${#bad[@]} failed"
((${#bad[@]} == 0))
