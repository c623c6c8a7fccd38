"""`epd bench`: load any OpenAI-compatible chat server and time it (as `vllm bench serve`)."""
