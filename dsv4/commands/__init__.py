"""The `dsv4` console script and its subcommands: the one place that assembles services
(router, prefill and decode workers, local clusters) from the packages below it."""
