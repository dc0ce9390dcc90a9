// One file, against one server. The suite gives its slow tests their own timeouts; the
// default (5 s) is raised for a loaded CI machine, where a test that waits out one
// server long-poll (--ds-long-poll 0.5) and a few round trips can take longer.
import { defineConfig } from "vitest/config"

export default defineConfig({
  test: {
    include: ["conformance.test.mjs"],
    testTimeout: 20000,
  },
})
