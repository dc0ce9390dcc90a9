#!/usr/bin/env bash
# Set up Sluice in ./.venv; idempotent. `scripts/setup.sh --test` also installs what the
# test suite needs (the test extras and Debian's Chromium for the browser tests).
set -euo pipefail
cd "$(dirname "$0")/.."

want_test=0
[[ "${1:-}" == "--test" ]] && want_test=1

packages=()
python3 -c 'import ensurepip, venv' 2>/dev/null || packages+=(python3-venv)
if ((want_test)) && [[ ! -x /usr/bin/chromium ]]; then
    packages+=(chromium)
fi
if ((${#packages[@]})); then
    sudo=""
    [[ "$(id -u)" -ne 0 ]] && sudo="sudo"
    echo "setup: installing Debian packages: ${packages[*]}"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${packages[@]}" >/dev/null
fi

[[ -x .venv/bin/python ]] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
if ((want_test)); then
    .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
else
    .venv/bin/python -m pip install -q --disable-pip-version-check -e .
fi
