"""The on-disk layout of a published weight version, shared by the publisher (rollout/weights.py, no
vLLM import) and the `file` engine inside vLLM (rollout/vllm_plugin/file_engine.py).

A version is the directory `<weight_dir>/v<N>/` holding `model-<i>-of-<K>.safetensors` shards
(5-digit numbers, HF's naming). While it is written it lives in a temporary directory where each
shard appears by an atomic rename once whole; a publisher whose write fails leaves an `ABORTED`
file there saying why, so a worker streaming the version stops instead of waiting.
"""

ABORT_MARKER = "ABORTED"


def shard_name(index: int, count: int) -> str:
    """File name of shard `index` (0-based) of a version written as `count` shards."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"
