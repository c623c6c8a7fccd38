"""KV memory, the one home of it in every role: blocks, their content hashes, the pool."""
