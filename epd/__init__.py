"""epd: encode/prefill/decode disaggregated serving for Kimi-VL."""

__version__ = "0.1.0"
