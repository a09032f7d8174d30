import react from "@vitejs/plugin-react";
import { defineConfig, loadEnv } from "vite";

// The gateway serves dist/ at "/" and the API under /api on the same origin (or both under one
// sub-path, behind an ingress); `npm run dev`
// proxies /api to a gateway, by default the one `strata up` starts on port 8080
// (STRATA_GATEWAY_URL=http://host:port npm run dev to point elsewhere).
export default defineConfig(({ mode }) => {
  const env = loadEnv(mode, ".", "STRATA_");
  const gateway = env["STRATA_GATEWAY_URL"] ?? "http://127.0.0.1:8080";
  return {
    // Relative asset paths: the same build serves at "/" and behind an ingress sub-path.
    base: "./",
    plugins: [react()],
    build: {
      outDir: "dist",
      emptyOutDir: true,
      target: "es2022",
    },
    server: {
      host: "127.0.0.1",
      proxy: { "/api": { target: gateway } },
    },
  };
});
