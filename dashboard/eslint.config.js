// ESLint for the dashboard: eslint-plugin-react-hooks' recommended rules (the rules of hooks and
// the React Compiler's checks) and ESLint's own recommended checks. TypeScript is parsed with
// Babel's preset, as the project's TypeScript (the native compiler, `tsc --noEmit` in the build)
// checks the types.
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
      // The plugin's recommended rules: the rules of hooks and the React Compiler's checks
      // (set-state-in-effect, purity, refs, ...), with missing effect dependencies and
      // everything else an error rather than a warning.
      ...Object.fromEntries(
        Object.keys(reactHooks.configs.flat.recommended.rules).map((rule) => [rule, "error"]),
      ),
      // Types and type-only imports are checked by tsc (noUnusedLocals), which sees them.
      "no-unused-vars": "off",
      "no-undef": "off",
    },
  },
];
