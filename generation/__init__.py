"""Teacher generation: local transformers models (and, later, OpenAI-compatible endpoints and vLLM)."""
