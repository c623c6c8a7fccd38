"""Prefill's engine and wire side: gathers image embeddings, prefills, hands KV to decode."""
