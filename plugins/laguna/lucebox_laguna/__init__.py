"""Lucebox plugin for Poolside Laguna (GGUF architecture `laguna`)."""
