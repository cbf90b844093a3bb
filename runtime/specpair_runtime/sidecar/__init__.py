"""The gate sidecar: alignment and golden prompts for a pair served by another engine (vLLM)."""
