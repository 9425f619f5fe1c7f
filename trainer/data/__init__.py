"""Pretraining data: tokenizers (tokenizer), `slipstream prep` turning raw text sources into token shards
(prep), the shard format and its reader (shards), and the seeded, resumable mixture of sources that the
pretraining driver draws its rows from (mixture)."""
