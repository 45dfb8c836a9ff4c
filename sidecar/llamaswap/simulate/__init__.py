"""`llamaswap simulate`: recorded or synthetic traffic replayed through the real scheduling core.

- `records`: the activity log parsed into typed records (junk lines skipped and counted);
- `workload`: synthetic traffic from a YAML description, as the same records;
- `settings`: where each setting comes from, validation, sweeps;
- `concurrency`: how concurrent generations share the GPU, the table measured from a log;
- `engine`: the replay itself over `llamaswap.core.Scheduler` and a `ManualClock` (no I/O);
- `results`: what a replay produced (each request, the metrics, the worst inversion);
- `inversion`: the worst priority inversion of a replay;
- `report`: rows as a table, JSON, per-request lines and a plot;
(The `simulate` subcommand itself is `llamaswap.commands.simulate`.)
"""
