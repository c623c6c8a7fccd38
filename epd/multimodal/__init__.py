"""Images to model inputs: grid metadata, the Kimi-VL image processor and prompt building."""
