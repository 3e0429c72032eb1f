"""The server's frontend on an event loop of its own, for `rsgl.Engine(dp_size > 1)`.

An Engine with several data-parallel ranks runs them as scheduler processes, exactly as
`rsgl serve --dp-size N` does, and drives them through the same `Frontend` and dispatcher:
one request path. The Engine's callers are plain threads (or another event loop), so the
frontend gets a thread and an asyncio loop here; callers submit through
`run_coroutine_threadsafe` and read their requests' outputs from thread-safe
`OutputQueue`s they bring (fed from the frontend's loop).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from rsgl.args import EngineArgs
from rsgl.reasoning import reasoning_end_ids
from rsgl.server.frontend import Frontend, sum_stats
from rsgl.server.metrics import ServerMetrics
from rsgl.server.ranks import SchedulerRanks, check_data_parallel
from rsgl.tokenizer.loader import load_tokenizer
from rsgl.tokenizer.output_processor import OutputQueue
from rsgl.validation import Job

T = TypeVar("T")

# The metrics registry needs a model name; an Engine serves no /metrics.
_MODEL_NAME = "rsgl-engine"
# What a rank's `Ready` info says of the model, as `Engine.get_server_info` reports it.
_MODEL_FACTS = (
    "dtype",
    "dtype_choice",
    "speculative_algorithm",
    "speculation_choice",
    "quantization",
    "low_bit_max_rows",
    "cpu_threads",
    "context_length",
    "max_total_tokens",
    "kv_buffer_size",
    "kv_cache_storage_dtype",
    "model_dir",
    "attention_backend",
    "cuda_graphs",
)


class ThreadedFrontend:
    """`args.dp_size` scheduler processes behind a `Frontend` running on a thread.

    Starting it loads the model in every rank (it returns once all are ready). If a rank
    dies, its requests fail and the others keep serving; once none is left, requests fail
    with EngineUnavailable.
    """

    def __init__(self, args: EngineArgs) -> None:
        check_data_parallel(args)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="rsgl-frontend", daemon=True
        )
        self._thread.start()
        self._tasks: list[asyncio.Future[Any]] = []
        self._closed = False
        self.ranks: SchedulerRanks | None = None
        self.frontend: Frontend | None = None
        try:
            self.tokenizer, self.frontend = self.run(self._start(args))
        except BaseException:
            self.shutdown()
            raise

    async def _start(self, args: EngineArgs) -> tuple[Any, Frontend]:
        # Made on the loop's thread: its asyncio sockets belong to this loop.
        self.ranks = ranks = SchedulerRanks(args)
        ranks.start()
        infos = await ranks.wait_ready()
        tokenizer = load_tokenizer(args.tokenizer_path or infos[0]["model_dir"])
        frontend = Frontend(
            tokenizer,
            infos,
            ServerMetrics(_MODEL_NAME, dp_size=args.dp_size),
            ranks.commands,
            ranks.events,
            load_balance_method=args.load_balance_method,
            stream_interval=args.stream_interval,
            reasoning_end_ids=reasoning_end_ids(tokenizer, args.reasoning_parser),
        )
        self._tasks.append(asyncio.ensure_future(frontend.run_events()))
        self._tasks.append(asyncio.ensure_future(ranks.watch(frontend, lambda: None)))
        return tokenizer, frontend

    @property
    def live(self) -> Frontend:
        """The frontend, once started."""
        if self.frontend is None or self._closed:
            raise RuntimeError("the engine has been shut down")
        return self.frontend

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs `coro` on the frontend's loop and waits for its result here."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def submit(self, jobs: Sequence[Job], queues: Sequence[OutputQueue], stream: bool) -> None:
        """Sends a call's requests, each with its queue; all or none (a failure aborts the
        ones already sent and raises)."""

        frontend = self.live

        async def send() -> None:
            sent: list[str] = []
            try:
                for job, queue in zip(jobs, queues, strict=True):
                    await frontend.submit(
                        job.rid, job.prompt_ids, job.params, 0, job.group, stream, queue=queue
                    )
                    sent.append(job.rid)
            except BaseException:
                for rid in sent:
                    frontend.abort(rid)
                raise

        self.run(send())

    def abort(self, rid: str) -> bool:
        frontend = self.live

        async def abort() -> bool:
            return frontend.abort(rid)

        return self.run(abort())

    def flush_cache(self) -> bool:
        return self.run(self.live.flush_cache())

    def check_integrity(self) -> None:
        self.run(self.live.check_integrity())

    def server_info(self) -> dict[str, Any]:
        """What `Engine.get_server_info` reports of the ranks: rank 0's model facts (the
        ranks are replicas), the live ranks' statistics as of now, summed, the steps they
        ran, and one entry per rank (`internal_states`, as the server's /server_info)."""
        frontend = self.live
        per_rank = self.run(frontend.fetch_stats())
        first = frontend.info
        info = {key: first.get(key) for key in _MODEL_FACTS}
        loop_counters = ("steps", "step_failures", "rss_bytes")
        core = [{k: v for k, v in s.items() if k not in loop_counters} for s in per_rank.values()]
        info["stats"] = sum_stats(core)
        info["steps"] = sum(int(s.get("steps", 0)) for s in per_rank.values())
        info["internal_states"] = [
            dict(
                per_rank.get(rank, {}),
                dp_rank=rank,
                scheduler_pid=frontend.rank_infos[rank].get("scheduler_pid"),
                alive=rank not in frontend.dead_ranks,
            )
            for rank in range(frontend.dp_size)
        ]
        return info

    def shutdown(self) -> None:
        """Aborts what is left, stops the ranks and the loop. Idempotent."""
        if self._closed:
            return
        self._closed = True

        async def stop() -> None:
            if self.frontend is not None:
                self.frontend.abort_all("the engine is shutting down")
            # The watchdog goes first (stopping ranks are no failure); the event reader
            # keeps reading while the ranks stop, and goes before their sockets.
            for task in self._tasks[1:]:
                task.cancel()
            if self.ranks is not None:
                await self.ranks.stop()
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            if self.ranks is not None:
                self.ranks.close()

        try:
            self.run(stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
