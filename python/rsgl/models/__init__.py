"""Llama-family models and weight loading (`rsgl.models.loader.load_model`)."""
