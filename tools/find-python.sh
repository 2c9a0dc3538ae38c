#!/usr/bin/env bash
# Prints the path of a working Python 3.12 interpreter, or fails with a message saying how to get one.
# Tried in order: $PYTHON, python3.12 on PATH, pyenv's 3.12.x, common install prefixes, uv.
set -u
try() { [ -n "${1:-}" ] && "$1" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && { command -v "$1" || echo "$1"; } && exit 0; }
if [ -n "${PYTHON:-}" ]; then
  try "$PYTHON"
  echo "error: PYTHON=$PYTHON is not a working Python 3.12 ($("$PYTHON" -c 'import sys; print("Python", sys.version.split()[0])' 2>&1 | head -1)): set PYTHON to a python3.12, or unset it to search" >&2
  exit 1
fi
try "$(command -v python3.12 2>/dev/null)"
if command -v pyenv >/dev/null 2>&1; then
  for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.|$)' | sort -rV); do
    try "$(PYENV_VERSION=$v pyenv which python3.12 2>/dev/null)"
  done
fi
for p in "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12 /opt/python*/bin/python3.12; do
  try "$p"
done
if command -v uv >/dev/null 2>&1; then try "$(uv python find 3.12 2>/dev/null)"; fi
echo "error: no Python 3.12 found (the version this project pins torch 2.11 and megatron-core 0.19.2 for and tests on). Install python3.12 (Debian: apt install python3.12 python3.12-venv) or set PYTHON=/path/to/python3.12." >&2
exit 1
