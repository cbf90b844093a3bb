"""The OpenAI-compatible HTTP server of the runtime (``specpair-runtime serve``)."""
