"""STANDALONE speculation: a second, smaller model of the same tokenizer drafts the tokens
each verify step checks (SGLang's `--speculative-algorithm STANDALONE`).

The draft model keeps its own KV cache in the target's slots: it reads the target runner's
req_to_token rows, so the one plan the core makes serves both models and every free the core
makes frees both caches. It computes every position the target computes:

- a prefill or a plain decode step runs the draft over the same batch before the target
  (`follow`: its KV only; the logits are not needed);
- a verify step (the core reserved k placeholder drafts per drafting request, id 0) first
  runs k + 1 one-token decodes of the draft (`propose`): decode i reads the token at the
  request's position L + i (its last committed token, then its drafts) and writes its KV,
  and its argmax is draft i + 1. The last decode only writes KV, so the draft holds every
  position the verify may keep, up to all k drafts accepted. A row without drafts (a
  constrained or pausing request) takes part in the first decode only.

Drafts are the draft model's argmax (deterministic), so the verify's exact acceptance rule
keeps greedy output identical and sampled output's distribution unchanged; only the share
of drafts accepted depends on how well the draft model predicts the target.
"""

from __future__ import annotations

import numpy as np
import torch

from rsgl.layers.attention import AttentionBackend, create_attention_backend
from rsgl.model_executor.forward_batch import ForwardBatch, ForwardMode
from rsgl.model_executor.kv_cache import KVCache, ReqToTokenPool
from rsgl.models.loader import LoadedModel


class DraftModel:
    """A draft model over the target runner's slots (see the module docstring)."""

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        target_vocab_size: int,
        kv_buffer_size: int,
        kv_dtype: torch.dtype,
        req_to_token: ReqToTokenPool,
        attention_backend: str,
    ) -> None:
        cfg = loaded.config
        if cfg.vocab_size != target_vocab_size:
            raise ValueError(
                f"the draft model's vocabulary has {cfg.vocab_size} tokens and the target's "
                f"{target_vocab_size}: a STANDALONE draft must share the target's tokenizer"
            )
        if loaded.tp is not None:
            raise ValueError("a STANDALONE draft model runs on one rank (no tensor parallelism)")
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.kv_cache = KVCache.for_model(cfg, kv_buffer_size, kv_dtype, self.device, kv_heads)
        self.attn: AttentionBackend = create_attention_backend(
            attention_backend,
            self.kv_cache,
            req_to_token,
            heads,
            kv_heads,
            cfg.head_dim,
            model_dtype=loaded.dtype,
        )

    def follow(self, input_ids: torch.Tensor, batch: ForwardBatch) -> None:
        """Writes the draft's KV for a step the target runs (a prefill or plain decode)."""
        self.attn.prepare(batch)
        self.model(input_ids, batch, self.attn)

    def propose(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """`input_ids` of a verify batch with each request's placeholder drafts replaced
        by the draft model's (and the draft's KV written for every position of the batch).
        The batch holds only decoding requests: each one's 1 + k tokens, in order."""
        drafts = batch.draft_lens_host
        assert drafts is not None
        if not np.array_equal(batch.extend_lens_host, drafts + 1):
            raise ValueError("a verify batch holds decoding requests only (1 + k tokens each)")
        positions = batch.positions.cpu().numpy()
        out_cache_loc = batch.out_cache_loc.cpu().numpy()
        starts = np.cumsum(drafts + 1) - (drafts + 1)
        ids = input_ids.clone()
        for i in range(int(drafts.max()) + 1):
            rows = np.flatnonzero(drafts >= i)
            tokens = starts[rows] + i  # each row's token at position L + i
            step = ForwardBatch.from_arrays(
                forward_mode=ForwardMode.DECODE,
                req_slots=batch.req_slots_host[rows],
                prefix_lens=positions[tokens],
                extend_lens=np.ones(len(rows), dtype=np.int64),
                input_ids=np.zeros(len(rows), dtype=np.int64),  # read from `ids` below
                positions=positions[tokens],
                out_cache_loc=out_cache_loc[tokens],
                device=self.device,
            )
            index = torch.from_numpy(tokens).to(self.device)
            self.attn.prepare(step)
            logits = self.model(ids[index], step, self.attn)
            more = drafts[rows] > i  # rows whose draft i + 1 comes from this decode
            if more.any():
                nxt = torch.from_numpy(tokens[more] + 1).to(self.device)
                chosen = torch.from_numpy(np.flatnonzero(more)).to(self.device)
                ids[nxt] = logits[chosen].argmax(dim=-1)
        return ids


__all__ = ["DraftModel"]
