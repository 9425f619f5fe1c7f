"""The built-in benchmarks: held-out arithmetic, GSM8K-format JSONL math and IFEval-style instruction
following (registered by name in `evaluator.benchmark.BENCHMARKS`; their data is in evaluator/data)."""
