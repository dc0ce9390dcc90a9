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
# Two workers, a module each at a time (its session and module fixtures start once per
# worker); the suite is about half as long as serially on two cores.
.venv/bin/pytest -n 2 --dist loadfile "$@"
