"""lucebox-gemma4: the Gemma-4 family (GGUF architecture `gemma4`) for Lucebox, dense (31B) and MoE (26B-A4B)."""
