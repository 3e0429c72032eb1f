//! Criterion micro-benchmarks: radix match / insert / evict on large trees, the page
//! allocator, one full decode step (schedule + commit) at 64, 256 and 1024 running, and one
//! prefill step (schedule + commit) of requests sharing a system prompt.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion};
use scheduler_core::{RadixTree, SamplingLimits, Scheduler, SchedulerConfig, TokenPool};

/// Deterministic pseudo-random token stream.
fn tokens(seed: u64, n: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            10 + (x % 32000) as u32
        })
        .collect()
}

/// A tree shaped like shared-prefix serving traffic: `groups` system prompts of 1024 tokens,
/// each with `per_group` 256-token continuations. Returns the tree and the inserted keys.
fn large_tree(page: usize, groups: usize, per_group: usize) -> (RadixTree, Vec<Vec<u32>>) {
    let mut tree = RadixTree::new(page, false);
    let mut keys = Vec::new();
    let mut slot = 1u32;
    for g in 0..groups {
        let system = tokens(g as u64, 1024);
        for q in 0..per_group {
            let mut key = system.clone();
            key.extend(tokens((g * 1000 + q) as u64 + 7, 256));
            let values: Vec<u32> = (slot..slot + key.len() as u32).collect();
            slot += key.len() as u32;
            tree.insert(&key, &values);
            keys.push(key);
        }
    }
    (tree, keys)
}

fn radix(c: &mut Criterion) {
    let mut group = c.benchmark_group("radix");
    for page in [1usize, 16] {
        let (mut tree, keys) = large_tree(page, 64, 32);
        let mut values = Vec::with_capacity(2048);
        let mut i = 0;
        group.bench_function(BenchmarkId::new("match_1280_hit", page), |b| {
            b.iter(|| {
                values.clear();
                i = (i + 1) % keys.len();
                black_box(tree.match_prefix(&keys[i], &mut values));
            })
        });
        let mut n = 0u64;
        group.bench_function(
            BenchmarkId::new("insert_1024_shared_plus_256_new", page),
            |b| {
                b.iter_batched(
                    || {
                        n += 1;
                        let mut key = keys[(n as usize * 31) % keys.len()][..1024].to_vec();
                        key.extend(tokens(1_000_000 + n, 256));
                        let values = vec![1u32; key.len()];
                        (key, values)
                    },
                    |(key, values)| black_box(tree.insert(&key, &values)),
                    BatchSize::SmallInput,
                )
            },
        );
        group.bench_function(BenchmarkId::new("evict_4096_tokens", page), |b| {
            b.iter_batched(
                || large_tree(page, 16, 16).0,
                |mut t| {
                    let mut freed = Vec::with_capacity(4096);
                    black_box(t.evict(4096, &mut freed));
                    t
                },
                BatchSize::LargeInput,
            )
        });
    }
    group.finish();
}

fn allocator(c: &mut Criterion) {
    let mut group = c.benchmark_group("allocator");
    let mut pool = TokenPool::new(1 << 20, 16);
    group.bench_function("alloc_free_64_pages", |b| {
        b.iter(|| {
            let slots = pool.alloc_tokens(64 * 16).unwrap();
            pool.free(black_box(&slots));
        })
    });
    let mut pool = TokenPool::new(1 << 20, 1);
    group.bench_function("alloc_free_1_slot", |b| {
        b.iter(|| {
            let slot = pool.alloc_page().unwrap();
            pool.free(black_box(&[slot]));
        })
    });
    group.finish();
}

/// A scheduler with `running` requests decoding (prompts prefilled, ignore_eos).
fn decoding_scheduler(running: usize) -> Scheduler {
    let cfg = SchedulerConfig {
        max_total_tokens: running * 8192,
        max_running_requests: running,
        context_len: 1 << 20,
        max_prefill_tokens: running * 128,
        chunked_prefill_size: None,
        ..SchedulerConfig::default()
    };
    let mut s = Scheduler::new(cfg).unwrap();
    for rid in 0..running as u64 {
        let limits = SamplingLimits {
            max_new_tokens: 1 << 20,
            ignore_eos: true,
            ..Default::default()
        };
        s.add_request(rid, tokens(rid, 100), limits).unwrap();
    }
    let plan = s.schedule();
    assert_eq!(plan.rids.len(), running);
    s.commit(plan.id, &vec![11; running]).unwrap();
    s
}

/// Decode steps a scheduler from [`decoding_scheduler`] runs before it is rebuilt (its
/// requests may produce 4096 tokens each, and the pool holds them all).
const STEPS_PER_SCHEDULER: u64 = 2048;

fn step(c: &mut Criterion) {
    let mut group = c.benchmark_group("schedule_commit_decode");
    for running in [64usize, 256, 1024] {
        let next = vec![12i64; running];
        group.bench_function(BenchmarkId::from_parameter(running), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                let mut s = decoding_scheduler(running);
                for i in 0..iters {
                    if i > 0 && i % STEPS_PER_SCHEDULER == 0 {
                        s = decoding_scheduler(running); // outside the timed region
                    }
                    let start = Instant::now();
                    let plan = s.schedule();
                    black_box(s.commit(plan.id, &next).unwrap());
                    total += start.elapsed();
                }
                total
            })
        });
    }
    group.finish();
}

/// A scheduler with `n` waiting requests: a shared 1024-token system prompt plus 128 tokens
/// of their own, page size `page`.
fn prefilling_scheduler(n: usize, page: usize) -> Scheduler {
    let cfg = SchedulerConfig {
        max_total_tokens: n * 4096,
        page_size: page,
        max_running_requests: n,
        context_len: 1 << 16,
        max_prefill_tokens: n * 2048,
        chunked_prefill_size: None,
        ..SchedulerConfig::default()
    };
    let mut s = Scheduler::new(cfg).unwrap();
    let system = tokens(1, 1024);
    for rid in 0..n as u64 {
        let limits = SamplingLimits {
            max_new_tokens: 1024,
            ignore_eos: true,
            ..Default::default()
        };
        let mut prompt = system.clone();
        prompt.extend(tokens(rid + 100, 128));
        s.add_request(rid, prompt, limits).unwrap();
    }
    s
}

fn prefill_step(c: &mut Criterion) {
    let mut group = c.benchmark_group("schedule_commit_prefill");
    let n = 64;
    for page in [1usize, 16] {
        let next = vec![12i64; n];
        group.bench_function(BenchmarkId::new("64x1152_shared_1024", page), |b| {
            b.iter_batched(
                || prefilling_scheduler(n, page),
                |mut s| {
                    let plan = s.schedule();
                    assert_eq!(plan.rids.len(), n);
                    black_box(s.commit(plan.id, &next).unwrap());
                    (s, plan)
                },
                BatchSize::LargeInput,
            )
        });
    }
    group.finish();
}

criterion_group!(benches, radix, allocator, step, prefill_step);
criterion_main!(benches);
