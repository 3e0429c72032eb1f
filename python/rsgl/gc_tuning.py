"""Keeping Python's garbage collector off the serving path.

A full (generation 2) collection scans every tracked object. After start-up a process holds
hundreds of thousands of them that live forever (the model's modules, the tokenizer, the
libraries), and a busy engine allocates enough to trigger such a collection every few
seconds: measured with the null executor at 1,024 running requests, p99 step time went from
~7 ms to ~130 ms because of it. Freezing what start-up built moves it out of the
collector's sight; later collections scan only what serving allocates.
"""

from __future__ import annotations

import atexit
import gc


def freeze_startup_objects() -> None:
    """Collect once, then freeze everything alive (call at the end of start-up). At exit
    they are unfrozen, so interpreter shutdown still finalizes them (extensions that count
    their live objects, as triton's do, would otherwise report leaks)."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)
