"""What every role shares, as a library: the config schema, rendezvous through a meet directory to Redis,
the Redis key schema, heartbeats, metrics (DuckDB), HTTP retries, addresses, the log format,
process helpers, the per-process run context and asyncio task stops. The tooling around runs (the
command line, launcher, scripts, registry, dashboard) is common/runs/."""
