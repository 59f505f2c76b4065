"""The llama.cpp engine: a real GGUF model, continuous batching in one llama.cpp context (engine.py)."""
