"""What every role shares: the config schema, rendezvous through a meet directory to Redis, the
Redis key schema, the command line, the local launcher and script builder, metrics (DuckDB), the
run registry (SQLite) and the log format."""
