// ESLint for the page at /ui: plain browser JavaScript (a classic script, no modules, no build).
import js from "@eslint/js";
import globals from "globals";

export default [
  js.configs.recommended,
  {
    files: ["**/*.js"],
    languageOptions: {
      ecmaVersion: 2022,
      sourceType: "script",
      globals: { ...globals.browser },
    },
    rules: {
      curly: "error",
      eqeqeq: "error",
      "no-implicit-globals": "error",
      "no-shadow": "error",
      "no-unused-vars": ["error", { args: "all", argsIgnorePattern: "^_" }],
      "no-var": "error",
      "prefer-const": "error",
      strict: ["error", "global"],
    },
  },
];
