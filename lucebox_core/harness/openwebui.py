"""Open WebUI (placeholder while being written)."""
