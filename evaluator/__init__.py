"""The evaluator role: benchmarks (cases plus scorers), an async runner against any
OpenAI-compatible URL, and a watcher that evaluates every published policy version during training."""
