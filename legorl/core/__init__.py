"""The core every stage stands on: the shard contract (schemas, the shard files), errors, paths."""
