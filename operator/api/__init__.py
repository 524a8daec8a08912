"""The InferenceService API: its models, CEL rules, validation, CRD and chart values."""
