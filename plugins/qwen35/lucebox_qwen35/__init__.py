"""Lucebox model family plugin for Qwen3.5 / Qwen3.6 (GGUF architecture `qwen35`)."""

__version__ = "0.1.0"
