"""The HTTP server: an OpenAI-compatible frontend process and a scheduler process."""
