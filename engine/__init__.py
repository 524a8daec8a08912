"""SuperInfer engine: an SLO-aware LLM serving engine."""
