"""Turning logits into replies: sampling, incremental detokenisation and stop rules."""
