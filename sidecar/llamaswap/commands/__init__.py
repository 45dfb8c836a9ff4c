"""The entry points: `llamaswap` and its subcommands (argument parsing, then the work's composition).

- `main`: the argparse entry, `llamaswap` (and `python -m llamaswap`);
- `serve`: the sidecar process (gRPC for Envoy, the admin HTTP server, reload);
- `up`: the whole stack on one machine (Envoy, the sidecar, the upstream);
- `queue`: `llamaswap queue`, the live queue from the admin HTTP server;
- `simulate`: `llamaswap simulate`, a replay through the real core.
"""
