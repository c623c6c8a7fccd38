"""The OpenAI-compatible HTTP API, and the `epd prefill` process that serves it."""
