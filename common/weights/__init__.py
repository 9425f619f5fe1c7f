"""Versioned weight sync: how a published policy version gets from the trainer onto the rollout workers, and
the records around it. One module per concept, imported directly (this package re-exports nothing, so
importing `common.weights.fleet` stays torch-free for the router and the evaluator):

- base, file, nccl, factory: the transport interface and its two transports; publisher drives one publish.
- writer, export, index: the `file` transport's streamed shards, HF naming, the on-disk index and checksums.
- versions: version directories, pins and pruning; lineage: which version holds which trainer step.
- fleet: the worker records in Redis; workers: driving one worker's weight-sync routes over HTTP.

The receiving side inside vLLM is rollout/vllm_plugin/.
"""
