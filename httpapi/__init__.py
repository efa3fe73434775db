"""The OpenAI-compatible HTTP layer (a top-level `http` would shadow the standard library)."""
