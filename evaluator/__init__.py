"""The evaluator role: benchmarks (cases plus scorers), an async runner against any
OpenAI-compatible URL, and a watcher that evaluates every published policy version during training.

Modules: `benchmark` (the protocol, metrics and the registry), `benchmarks/` (held-out arithmetic,
GSM8K-format math, IFEval-style instructions; data in `data/`), `backend` (the HTTP edge: model
discovery, prompt token counts, retries), `cache` (the versioned result cache), `runner` (one
benchmark at one version, and `slipstream eval`), `role` (ROLE=evaluator; the verify mode), `pinned`
(the pin mode), `watch_loop` (the loop both modes run)."""
