"""Model building blocks: norms, rotary embeddings, attention backends and the sampler."""
