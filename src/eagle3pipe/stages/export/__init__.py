"""The export stage: the trained draft in both layouts vLLM loads, contract-checked."""
