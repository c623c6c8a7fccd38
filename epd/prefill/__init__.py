"""The prefill process: hosts the API, gathers image embeddings, prefills, hands KV to decode."""
