"""safetensors files: the sliced reader (reader), the size-capped writer (shard_stream, writer) and durable writes
(durable)."""
