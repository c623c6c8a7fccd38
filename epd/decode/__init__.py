"""The decode process: continuous batching over every live sequence."""
