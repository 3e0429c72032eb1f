"""The compiler of constraints: one compile per constraint however many wait, hits served
from a byte-capped LRU cache, failures cached, the backend built ahead (prewarm) or when first
needed."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
from grammar_walk import backend_for

from rsgl.grammar.backend import GrammarBackend, GrammarError, Matcher
from rsgl.grammar.compiler import COMPILE_NICE, GrammarCompiler
from rsgl.grammar.constraint import Constraint


class Counting(GrammarBackend):
    """The real backend, counting compiles; `gate` holds each compile until it is set."""

    name = "counting"

    def __init__(self, real: GrammarBackend, size: int | None = None) -> None:
        super().__init__(real.vocab_size)
        self.real, self.size = real, size
        self.compiles: list[Constraint] = []
        self.nice: list[int] = []  # each compile's thread's nice value
        self.policy: list[int] = []  # and its scheduling policy
        self.gate = threading.Event()
        self.gate.set()

    def compile(self, constraint: Constraint) -> Any:
        self.compiles.append(constraint)
        self.nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        self.policy.append(os.sched_getscheduler(threading.get_native_id()))
        self.gate.wait()
        return self.real.compile(constraint)

    def size_bytes(self, compiled: Any) -> int:
        return self.size if self.size is not None else self.real.size_bytes(compiled)

    def matcher(self, compiled: Any) -> Matcher:
        return self.real.matcher(compiled)

    def fill(self, matchers: Any, bitmask: Any) -> None:
        self.real.fill(matchers, bitmask)


SCHEMA = Constraint("json_schema", '{"type":"object","properties":{"a":{"type":"integer"}}}')


@pytest.fixture
def counting(tokenizer: Any) -> Counting:
    return Counting(backend_for("xgrammar", tokenizer))


def test_concurrent_requests_for_one_constraint_compile_it_once(counting: Counting) -> None:
    compiler = GrammarCompiler(lambda: counting)
    counting.gate.clear()
    futures = [compiler.submit(SCHEMA) for _ in range(8)]
    counting.gate.set()
    results = [f.result(timeout=60) for f in futures]
    assert len(counting.compiles) == 1
    assert all(r is results[0] for r in results)
    later = compiler.submit(SCHEMA).result(timeout=60)
    assert later is results[0] and len(counting.compiles) == 1
    assert (compiler.stats.misses, compiler.stats.hits) == (1, 8)
    compiler.shutdown()


def test_a_failure_is_cached_and_reported_to_every_waiter(counting: Counting) -> None:
    compiler = GrammarCompiler(lambda: counting)
    bad = Constraint("regex", "a(")
    for _ in range(3):
        with pytest.raises(GrammarError):
            compiler.submit(bad).result(timeout=60)
    assert len(counting.compiles) == 1 and compiler.stats.failures == 1
    compiler.shutdown()


def test_the_cache_evicts_the_least_recently_used_past_its_byte_cap(tokenizer: Any) -> None:
    counting = Counting(backend_for("xgrammar", tokenizer), size=400)
    compiler = GrammarCompiler(lambda: counting, cache_bytes=1000)
    a, b, c = (Constraint("regex", r) for r in ("a+", "b+", "c+"))
    for constraint in (a, b, a, c):  # a is used again after b, so b goes when c comes
        compiler.submit(constraint).result(timeout=60)
    assert counting.compiles == [a, b, c]
    compiler.submit(a).result(timeout=60)
    assert counting.compiles == [a, b, c]
    compiler.submit(b).result(timeout=60)
    assert counting.compiles == [a, b, c, b]
    assert compiler.stats.cached_bytes <= 1000 and compiler.stats.cached_grammars == 2
    compiler.shutdown()


def test_prewarm_builds_the_backend_before_any_constraint(counting: Counting) -> None:
    built: list[int] = []

    def make() -> GrammarBackend:
        built.append(threading.get_native_id())
        return counting

    compiler = GrammarCompiler(make)
    assert compiler.prewarm().result(timeout=60) is counting
    assert built and built[0] != threading.get_native_id()  # on the pool, not the caller
    compiler.submit(SCHEMA).result(timeout=60)
    assert len(built) == 1 and counting.compiles == [SCHEMA]  # built once, then reused
    compiler.shutdown()


def test_a_prewarm_that_fails_is_retried_and_reported_by_the_first_compile() -> None:
    tries: list[int] = []

    def make() -> GrammarBackend:
        tries.append(1)
        raise RuntimeError("no backend here")

    compiler = GrammarCompiler(make)
    with pytest.raises(RuntimeError, match="no backend here"):
        compiler.prewarm().result(timeout=60)
    with pytest.raises(RuntimeError, match="no backend here"):
        compiler.submit(SCHEMA).result(timeout=60)
    assert len(tries) == 2 and compiler.stats.failures == 0
    compiler.shutdown()


def test_without_a_prewarm_the_backend_is_built_on_first_use_only() -> None:
    built: list[str] = []

    def make() -> GrammarBackend:
        built.append("x")
        raise RuntimeError("no backend here")

    compiler = GrammarCompiler(make)
    assert built == []
    with pytest.raises(RuntimeError, match="no backend here"):
        compiler.submit(SCHEMA).result(timeout=60)
    assert built == ["x"] and compiler.stats.failures == 0  # not the constraint's fault
    compiler.shutdown()


def test_compiles_run_at_the_lowest_priority_and_leave_the_caller_alone(
    counting: Counting,
) -> None:
    # A schema that compiles for seconds must not take a core from the steps' threads.
    caller = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    compiler = GrammarCompiler(lambda: counting)
    compiler.submit(SCHEMA).result(timeout=60)
    assert counting.nice == [COMPILE_NICE]
    assert counting.policy == [os.SCHED_IDLE]  # it runs only where a core would idle
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == caller
    assert os.sched_getscheduler(threading.get_native_id()) != os.SCHED_IDLE
    compiler.shutdown()
