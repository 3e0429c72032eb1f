"""Execution side of a step: KV cache, forward batch, FutureMap and the model runner."""
