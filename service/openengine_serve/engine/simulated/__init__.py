"""The simulated engine: one token per running output per step from a deterministic model on the Qwen3
vocabulary (for frontend benchmarks and deterministic tests)."""
