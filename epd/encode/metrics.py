"""What the encode process measures."""

from __future__ import annotations

from epd.runtime.metrics import RoleMetrics


class EncodeMetrics(RoleMetrics):
    role = "encode"

    def __init__(self, model_name: str) -> None:
        super().__init__(model_name)
        self.images = self.counter("encode_images", "Images encoded.")
        self.encode_time = self.seconds(
            "encode_seconds",
            "Time to encode a batch of request parts (decode, preprocess, vision tower, "
            "projector), observed once per request in it.",
        )
        self.embedding_bytes = self.counter(
            "embedding_bytes_sent", "Bytes of image embeddings sent to prefills."
        )
        self.batch_size = self.sizes("encode_batch_size", "Encode requests in one forward.")
        self.failures = self.counter("encode_failures", "Encode requests answered with a Failure.")
