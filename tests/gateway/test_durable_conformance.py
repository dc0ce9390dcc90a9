"""The Durable Streams conformance suite (``@durable-streams/server-conformance-tests``
0.3.6, installed under ``tests/durable_js`` by ``scripts/setup.sh --test``) against a real
``sluice serve``: ``npx vitest run`` of ``tests/durable_js/conformance.test.mjs``, which calls
the package's ``runConformanceTests({baseUrl})`` with ``baseUrl`` ``http://HOST:PORT/v1/ds``.

The suite has 338 tests; the 6 of its reserved subscription APIs run only when asked for
(``subscriptions: true``), which Sluice does not serve, so they are skipped. Every other
test must pass: the counts are printed, and any failure fails this test with its name.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.server import ServerProcess

SUITE_DIR = Path(__file__).resolve().parents[1] / "durable_js"
# The suite's tests (0.3.6), and those it skips unless subscriptions are enabled.
NUM_TESTS = 338
NUM_SUBSCRIPTION_TESTS = 6
# What the reference server (@durable-streams/server, in memory) passes on this machine.
REFERENCE_PASSES = 326


@pytest.mark.timeout(900)
def test_conformance_suite_passes_every_test_it_runs(tmp_path: Path) -> None:
    npx = shutil.which("npx")
    assert npx is not None, "npx is missing: run scripts/setup.sh --test"
    assert (SUITE_DIR / "node_modules" / "@durable-streams").is_dir(), (
        "the suite is not installed: run scripts/setup.sh --test"
    )
    report = tmp_path / "vitest.json"
    # A short long-poll hold, as the suite's own runs of the reference server use (500 ms):
    # its tests that wait out a 204 have vitest's default timeout. A long keep-alive: Node's
    # fetch reuses a socket idle for 5 s as the server closes it (uvicorn's default, with no
    # Keep-Alive hint) and fails a PUT with "other side closed"; the suite idles 5 s in
    # its TTL tests. The CORS origin: its preflight test asks from https://example.com.
    options = (
        "--no-model",
        "--ds-long-poll",
        "0.5",
        "--keep-alive-timeout",
        "75",
        "--cors-origin",
        "*",
    )
    with ServerProcess(*options) as server:
        server.wait_ready()
        env = {**os.environ, "SLUICE_DS_BASE_URL": f"{server.base_url}/v1/ds"}
        run = subprocess.run(
            [npx, "vitest", "run", "--reporter=json", f"--outputFile={report}"],
            cwd=SUITE_DIR,
            env=env,
            capture_output=True,
            text=True,
            timeout=840,
            check=False,
        )
    assert report.is_file(), run.stdout[-4000:] + run.stderr[-4000:]
    result = json.loads(report.read_text())
    failures = [
        f"{test['fullName']}: {(test['failureMessages'] or [''])[0][:300]}"
        for suite in result["testResults"]
        for test in suite["assertionResults"]
        if test["status"] == "failed"
    ]
    passed = result["numPassedTests"]
    failed = result["numFailedTests"]
    skipped = result["numPendingTests"] + result["numTodoTests"]
    print(f"durable streams conformance: {passed} passed, {failed} failed, {skipped} skipped")
    assert not failures, "\n".join(failures)
    assert result["numTotalTests"] == NUM_TESTS
    assert skipped == NUM_SUBSCRIPTION_TESTS
    assert passed == NUM_TESTS - NUM_SUBSCRIPTION_TESTS
    assert passed >= REFERENCE_PASSES
    assert run.returncode == 0, run.stderr[-4000:]
