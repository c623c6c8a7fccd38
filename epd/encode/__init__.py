"""The encode process: images → MoonViT + projector → embeddings for prefill."""
