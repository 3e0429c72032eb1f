"""Speculative decoding: the acceptance of drafted tokens against the target's logits."""

from rsgl.speculative.accept import Accepted, accept_drafts, record_accepted

__all__ = ["Accepted", "accept_drafts", "record_accepted"]
