"""Turning logits into replies: the values that steer it, sampling, sequences and stop rules,
incremental detokenisation."""
