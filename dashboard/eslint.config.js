// ESLint for the dashboard: the rules of hooks (eslint-plugin-react-hooks) and ESLint's own
// recommended checks. TypeScript is parsed with Babel's preset, as the project's TypeScript
// (the native compiler, `tsc --noEmit` in the build) checks the types.
import js from "@eslint/js";
import babelParser from "@babel/eslint-parser";
import reactHooks from "eslint-plugin-react-hooks";
import globals from "globals";

export default [
  { ignores: ["dist/**", "node_modules/**", "src/generated/**"] },
  js.configs.recommended,
  {
    files: ["src/**/*.{ts,tsx}", "*.config.{js,ts}"],
    languageOptions: {
      parser: babelParser,
      parserOptions: {
        requireConfigFile: false,
        babelOptions: {
          babelrc: false,
          configFile: false,
          presets: ["@babel/preset-typescript", ["@babel/preset-react", { runtime: "automatic" }]],
        },
      },
      globals: { ...globals.browser, ...globals.node },
    },
    plugins: { "react-hooks": reactHooks },
    rules: {
      // The rules of hooks. The plugin's React Compiler checks (set-state-in-effect, purity,
      // ...) are left out: this build does not use the compiler, and the hooks reset their state
      // on a change of job inside their effects on purpose.
      "react-hooks/rules-of-hooks": "error",
      "react-hooks/exhaustive-deps": "error",
      // Types and type-only imports are checked by tsc (noUnusedLocals), which sees them.
      "no-unused-vars": "off",
      "no-undef": "off",
    },
  },
];
