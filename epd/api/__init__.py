"""The OpenAI-compatible HTTP API, hosted by the prefill process."""
