"""Kimi-VL as plain nn.Modules whose attribute paths equal the checkpoint's tensor names."""
