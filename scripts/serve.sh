#!/usr/bin/env bash
# Set up everything, then run the server: page at http://127.0.0.1:8000 (extra options are
# passed to `sluice serve`; see `.venv/bin/sluice serve --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/sluice serve "$@"
