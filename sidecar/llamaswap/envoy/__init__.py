"""Envoy: the contract with the sidecar, the bootstrap builder, and the binary.

- `contract`: header names, dynamic-metadata namespaces and keys, paths (what the adapters import);
- `bootstrap`: the bootstrap for a configuration (`llamaswap up`, `envoy-config`, the chart);
- `binary`: finding the Envoy binary and `envoy --mode validate`.

Nothing is imported here: the adapters import the contract without the bootstrap builder.
"""
