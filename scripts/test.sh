#!/usr/bin/env bash
# Set up everything the tests need, then run the whole suite: lint, types, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
echo "== ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== mypy --strict"
.venv/bin/mypy
echo "== pytest"
.venv/bin/pytest "$@"
