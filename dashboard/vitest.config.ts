import { defineConfig } from "vitest/config";

// Unit tests of the hooks (in jsdom: `@vitest-environment jsdom` atop their files) and
// formatters (in node, faster); the browser tests of the whole dashboard
// against a real gateway are in tests/e2e.
export default defineConfig({
  test: {
    environment: "node",
    include: ["src/**/*.test.{ts,tsx}"],
  },
});
