// The Durable Streams server conformance suite (@durable-streams/server-conformance-tests),
// run against the `sluice serve` whose /v1/ds base URL is $SLUICE_DS_BASE_URL.
// tests/gateway/test_durable_conformance.py starts the server and runs this file with
// `npx vitest run`; the package's own `--run` CLI finds no tests under vitest 4.
import { describe } from "vitest"
import { runConformanceTests } from "@durable-streams/server-conformance-tests"

const baseUrl = process.env.SLUICE_DS_BASE_URL
if (!baseUrl) {
  throw new Error("set SLUICE_DS_BASE_URL to the server's /v1/ds URL")
}

describe("Sluice /v1/ds", () => {
  runConformanceTests({ baseUrl })
})
