#!/usr/bin/env bash
# Print the path of the first Python >= 3.11 on PATH (or of the one given).
# Usage: bash bin/find_python.sh [python]
# Example: "$(bash bin/find_python.sh)" -m venv .venv
set -eu
candidates=("$@")
[ ${#candidates[@]} -gt 0 ] || candidates=(python3 python3.14 python3.13 python3.12 python3.11)
seen=""
for c in "${candidates[@]}"; do
    p=$(command -v "$c" 2>/dev/null) || continue
    v=$("$p" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || continue
    seen="$seen $c=$v"
    if "$p" -c 'import sys, venv; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
        echo "$p"
        exit 0
    fi
done
echo "error: no Python >= 3.11 found (looked for: ${candidates[*]}; found:${seen:- none})." >&2
echo "fix: install Python 3.11 or newer (macOS: 'brew install python@3.12'; Debian: 'apt-get install python3'), or name one: make setup BOOTSTRAP_PYTHON=/path/to/python3.12; see RUNBOOK.md#prerequisites" >&2
exit 1
