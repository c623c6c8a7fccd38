"""A Kimi-VL checkpoint directory: its configs, weights, tokenizer, and test-checkpoint maker."""
