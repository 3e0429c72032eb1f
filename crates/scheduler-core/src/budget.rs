//! Prefill admission budgets (SGLang's `PrefillAdder`) and the decode-reservation ratio.

/// Output tokens reserved per request are clipped to this (SGLang's `CLIP_MAX_NEW_TOKENS`), so
/// one request asking for a huge `max_new_tokens` does not block admission.
pub const CLIP_MAX_NEW_TOKENS: usize = 4096;

/// Decode steps over which `new_token_ratio` decays from its initial to its minimum value.
const DECAY_STEPS: f64 = 600.0;

/// The fraction of running requests' remaining output tokens that admission reserves KV for.
///
/// It starts at `0.7 × schedule_conservativeness` (capped at 1), decays linearly to 14% of that
/// over 600 decode steps while decoding goes well, jumps up after a retraction, and returns to
/// its initial value when the scheduler goes idle.
#[derive(Debug, Clone)]
pub struct NewTokenRatio {
    init: f64,
    min: f64,
    decay: f64,
    current: f64,
}

impl NewTokenRatio {
    /// The ratio for a given `schedule_conservativeness`.
    pub fn new(conservativeness: f64) -> Self {
        let init = (0.7 * conservativeness).min(1.0);
        let min = init * 0.14;
        Self {
            init,
            min,
            decay: (init - min) / DECAY_STEPS,
            current: init,
        }
    }

    /// Current value.
    pub fn get(&self) -> f64 {
        self.current
    }

    /// One decode step without retraction.
    pub fn decay_step(&mut self) {
        self.current = (self.current - self.decay).max(self.min);
    }

    /// Back to the initial value (idle).
    pub fn reset(&mut self) {
        self.current = self.init;
    }

    /// After a retraction: `min(1, (Σ out_len + 20·n) / (Σ max_new + 1))` over the requests
    /// that kept running.
    pub fn after_retraction(&mut self, decoded: usize, max_new: usize, remaining: usize) {
        let estimate = (decoded + 20 * remaining) as f64 / (max_new + 1) as f64;
        self.current = estimate.min(1.0);
    }
}

/// Outcome of trying to add one request, or the budget state after adding one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddResult {
    /// Room for more.
    Continue,
    /// Out of KV tokens: stop admitting this round.
    NoToken,
    /// Out of input or chunk budget: stop admitting this round.
    Other,
}

/// How much of a request's extend the round admits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// The whole extend.
    Whole,
    /// A page-aligned chunk of this many tokens; the request stays chunked.
    Chunk(usize),
}

/// Token budgets for one prefill round.
///
/// `rem_total = available + evictable − offset`, where the offset starts as the reservation for
/// running requests (`Σ min(max_new − out, 4096) × new_token_ratio`) and grows by each admitted
/// request's extend and reserved output. `rem_input` starts at `max_prefill_tokens` and
/// `rem_chunk` at `chunked_prefill_size` (if chunking is on); both shrink by admitted extends.
#[derive(Debug, Clone)]
pub struct PrefillAdder {
    page_size: usize,
    total_offset: f64,
    rem_input: i64,
    rem_chunk: Option<i64>,
    admitted: usize,
}

impl PrefillAdder {
    /// Budgets for a round. `running_reserve` is the running requests' decode reservation;
    /// `mixed_decodes` is the number of decode tokens that share the step in mixed mode.
    pub fn new(
        page_size: usize,
        running_reserve: f64,
        max_prefill_tokens: usize,
        chunked_prefill_size: Option<usize>,
        mixed_decodes: usize,
    ) -> Self {
        let mixed = mixed_decodes as i64;
        Self {
            page_size,
            total_offset: running_reserve + mixed as f64,
            rem_input: max_prefill_tokens as i64 - mixed,
            rem_chunk: chunked_prefill_size.map(|c| c as i64 - mixed),
            admitted: 0,
        }
    }

    fn ceil_page(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.page_size) * self.page_size
    }

    /// Remaining KV tokens given the pool's `available + evictable` right now.
    pub fn rem_total(&self, available_and_evictable: usize) -> f64 {
        available_and_evictable as f64 - self.total_offset
    }

    /// Requests admitted so far this round.
    pub fn admitted(&self) -> usize {
        self.admitted
    }

    /// KV tokens a new request needs: its extend (in pages), its clipped output reservation and
    /// one page of slack.
    pub fn need(&self, extend_len: usize, max_new_tokens: usize) -> usize {
        self.ceil_page(extend_len) + max_new_tokens.min(CLIP_MAX_NEW_TOKENS) + self.page_size
    }

    /// Checks a new request against the token and input budgets. Call it before locking the
    /// request's prefix and again after (the lock takes its prefix out of `evictable`).
    pub fn check_new(
        &self,
        extend_len: usize,
        max_new_tokens: usize,
        available_and_evictable: usize,
    ) -> Result<(), AddResult> {
        if self.need(extend_len, max_new_tokens) as f64 > self.rem_total(available_and_evictable) {
            return Err(AddResult::NoToken);
        }
        self.check_input(extend_len)
    }

    /// The input budget alone: the first request of a round is admitted whatever its length;
    /// later ones must fit in what `max_prefill_tokens` leaves.
    pub fn check_input(&self, extend_len: usize) -> Result<(), AddResult> {
        if self.admitted > 0 && self.ceil_page(extend_len) as i64 >= self.rem_input {
            return Err(AddResult::Other);
        }
        Ok(())
    }

    /// How much of a new request's extend fits the chunk budget, or `None` if not even a page.
    pub fn fit_new(&self, extend_len: usize) -> Option<Admission> {
        match self.rem_chunk {
            Some(rem) if self.ceil_page(extend_len) as i64 > rem => {
                let chunk = (rem.max(0) as usize) / self.page_size * self.page_size;
                (chunk > 0).then_some(Admission::Chunk(chunk))
            }
            _ => Some(Admission::Whole),
        }
    }

    /// Tokens of the resumed chunked request to run this round: its remaining extend, cut to
    /// the chunk budget (page-aligned) and to the KV tokens physically free (`room`). Zero means
    /// it cannot advance this round. The reservation is not applied: the request is already
    /// committed to.
    pub fn fit_chunked(&self, remaining: usize, room: usize) -> Admission {
        let limit = self
            .rem_chunk
            .map_or(usize::MAX, |r| r.max(0) as usize)
            .min(room);
        if remaining <= limit {
            Admission::Whole
        } else {
            Admission::Chunk(limit / self.page_size * self.page_size)
        }
    }

    /// Charges an admitted extend of `extend_len` tokens plus `reserved_new` output tokens.
    pub fn consume(&mut self, extend_len: usize, reserved_new: usize) {
        let extend = self.ceil_page(extend_len);
        self.total_offset += (extend + reserved_new.min(CLIP_MAX_NEW_TOKENS)) as f64;
        self.rem_input -= extend as i64;
        if let Some(rem) = self.rem_chunk.as_mut() {
            *rem -= extend as i64;
        }
        self.admitted += 1;
    }

    /// Gives back reserved tokens (a preempted running request no longer needs them).
    pub fn refund(&mut self, tokens: f64) {
        self.total_offset -= tokens;
    }

    /// Whether the round can take more requests.
    pub fn state(&self, available_and_evictable: usize) -> AddResult {
        if self.rem_total(available_and_evictable) <= 0.0 {
            AddResult::NoToken
        } else if self.rem_input <= 0 || self.rem_chunk.is_some_and(|r| r <= 0) {
            AddResult::Other
        } else {
            AddResult::Continue
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratio_decays_linearly_to_its_floor_and_resets() {
        let mut r = NewTokenRatio::new(1.0);
        assert!((r.get() - 0.7).abs() < 1e-12);
        for _ in 0..300 {
            r.decay_step();
        }
        assert!((r.get() - (0.7 + 0.098) / 2.0).abs() < 1e-9);
        for _ in 0..1000 {
            r.decay_step();
        }
        assert!((r.get() - 0.098).abs() < 1e-12);
        r.reset();
        assert!((r.get() - 0.7).abs() < 1e-12);
        assert_eq!(NewTokenRatio::new(2.0).get(), 1.0);
    }

    #[test]
    fn retraction_estimate_is_capped_at_one() {
        let mut r = NewTokenRatio::new(1.0);
        r.after_retraction(10, 1000, 2);
        assert!((r.get() - 50.0 / 1001.0).abs() < 1e-12);
        r.after_retraction(100, 10, 2);
        assert_eq!(r.get(), 1.0);
    }

    #[test]
    fn running_reservation_and_clip_limit_admission() {
        let adder = PrefillAdder::new(1, 900.0, 16384, None, 0);
        // 1000 - 900 = 100 left: extend 50 + min(10000, 4096) does not fit, extend 50 + 49 + 1 does.
        assert_eq!(adder.check_new(50, 10000, 1000), Err(AddResult::NoToken));
        assert_eq!(adder.check_new(50, 49, 1000), Ok(()));
        assert_eq!(adder.check_new(50, 50, 1000), Err(AddResult::NoToken));
        assert_eq!(adder.need(10, 100_000), 10 + CLIP_MAX_NEW_TOKENS + 1);
    }

    #[test]
    fn first_request_ignores_the_input_budget() {
        let mut adder = PrefillAdder::new(1, 0.0, 100, None, 0);
        assert_eq!(adder.check_new(500, 1, 10_000), Ok(()));
        adder.consume(500, 1);
        assert_eq!(adder.check_new(1, 1, 10_000), Err(AddResult::Other));
        assert_eq!(adder.state(10_000), AddResult::Other);
    }

    #[test]
    fn chunks_are_page_aligned() {
        let adder = PrefillAdder::new(16, 0.0, 16384, Some(100), 0);
        assert_eq!(adder.fit_new(90), Some(Admission::Whole));
        assert_eq!(adder.fit_new(101), Some(Admission::Chunk(96)));
        let small = PrefillAdder::new(16, 0.0, 16384, Some(10), 0);
        assert_eq!(small.fit_new(101), None);
        assert_eq!(adder.fit_chunked(1000, 50), Admission::Chunk(48));
        assert_eq!(adder.fit_chunked(40, 50), Admission::Whole);
    }
}
