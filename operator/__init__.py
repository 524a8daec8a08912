"""Kopf operator for InferenceService resources. Never imports torch or the engine."""
