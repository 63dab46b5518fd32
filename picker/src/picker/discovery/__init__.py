"""Discovery: which endpoints, InferenceObjectives and InferenceModelRewrites exist."""
