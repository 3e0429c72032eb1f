//! Allocators: KV cache slots (grouped in pages) and request slots (rows of `req_to_token`).

/// Index of one token's KV entry in the executor's K/V buffers.
pub type Slot = u32;

/// Allocator of KV cache slots in whole pages of `page_size` tokens.
///
/// Page 0 (slots `0..page_size`) is reserved as padding for the executor and never handed out,
/// so a zero slot in a buffer is always a padding write. The executor sizes its K/V buffers
/// with [`TokenPool::kv_buffer_size`].
#[derive(Debug, Clone)]
pub struct TokenPool {
    page_size: u32,
    num_pages: u32,
    /// Free page ids, popped from the end; initialised so that pages come out in ascending order.
    free_pages: Vec<u32>,
}

impl TokenPool {
    /// A pool with room for at least `num_tokens` tokens, rounded down to whole pages.
    pub fn new(num_tokens: usize, page_size: usize) -> Self {
        assert!(page_size > 0, "page_size must be positive");
        let num_pages = (num_tokens / page_size) as u32;
        Self {
            page_size: page_size as u32,
            num_pages,
            free_pages: (1..=num_pages).rev().collect(),
        }
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.page_size as usize
    }

    /// Usable tokens in the pool (whole pages, padding page excluded).
    pub fn capacity(&self) -> usize {
        self.num_pages as usize * self.page_size as usize
    }

    /// Rows the executor's K/V buffers need: the usable pages plus the padding page.
    pub fn kv_buffer_size(&self) -> usize {
        (self.num_pages as usize + 1) * self.page_size as usize
    }

    /// Free tokens (whole free pages).
    pub fn available(&self) -> usize {
        self.free_pages.len() * self.page_size as usize
    }

    /// Free pages.
    pub fn free_page_count(&self) -> usize {
        self.free_pages.len()
    }

    /// Takes `n` pages and returns their first slots, or `None` (taking nothing) if fewer are free.
    pub fn alloc_pages(&mut self, n: usize) -> Option<Vec<Slot>> {
        if n > self.free_pages.len() {
            return None;
        }
        let start = self.free_pages.len() - n;
        let firsts = self.free_pages[start..]
            .iter()
            .rev()
            .map(|&p| p * self.page_size)
            .collect();
        self.free_pages.truncate(start);
        Some(firsts)
    }

    /// Takes one page and returns its first slot.
    pub fn alloc_page(&mut self) -> Option<Slot> {
        self.free_pages.pop().map(|page| page * self.page_size)
    }

    /// Takes `n` token slots page by page (for `page_size == 1` this is token granularity).
    /// The unused tail of the last page stays with the caller's run: free it with [`free`](Self::free).
    pub fn alloc_tokens(&mut self, n: usize) -> Option<Vec<Slot>> {
        let mut slots = vec![0; n];
        self.alloc_tokens_into(&mut slots).then_some(slots)
    }

    /// [`alloc_tokens`](Self::alloc_tokens) into a caller's buffer; false (taking nothing) if
    /// the pool is short.
    pub fn alloc_tokens_into(&mut self, out: &mut [Slot]) -> bool {
        let p = self.page_size as usize;
        let pages = out.len().div_ceil(p);
        if pages > self.free_pages.len() {
            return false;
        }
        let start = self.free_pages.len() - pages;
        let taken = self.free_pages[start..].iter().rev();
        if p == 1 {
            // Token granularity: a page is a slot.
            out.iter_mut()
                .zip(taken)
                .for_each(|(slot, &page)| *slot = page);
            self.free_pages.truncate(start);
            return true;
        }
        for (chunk, &page) in out.chunks_mut(p).zip(taken) {
            let first = page * self.page_size;
            for (i, slot) in chunk.iter_mut().enumerate() {
                *slot = first + i as Slot;
            }
        }
        self.free_pages.truncate(start);
        true
    }

    /// Returns the pages that hold `slots`. A page is identified by its first slot, so every run
    /// handed back must start on a page boundary (true of request tails and tree values, which
    /// are page-aligned); slots that are not the first of their page are covered by that first.
    pub fn free(&mut self, slots: &[Slot]) {
        let p = self.page_size;
        if p == 1 {
            // Token granularity: every slot is a page (a copy, not a loop).
            debug_assert!(!slots.contains(&0), "slot 0 is the reserved padding page");
            self.free_pages.extend_from_slice(slots);
            return;
        }
        for &slot in slots {
            if slot % p == 0 {
                debug_assert!(slot >= p, "slot {slot} is in the reserved padding page");
                self.free_pages.push(slot / p);
            }
        }
    }

    /// [`free`](Self::free) for a run laid out as the scheduler keeps KV (request rows, tree
    /// values): it starts on a page boundary and slot `i` sits at offset `i % page_size` of its
    /// page, so every `page_size`-th slot is a page's first and only those are read. Returns
    /// the same pages in the same order as `free`.
    pub fn free_run(&mut self, run: &[Slot]) {
        let p = self.page_size;
        if p == 1 {
            self.free(run);
            return;
        }
        let firsts = run.iter().step_by(p as usize);
        debug_assert!(
            firsts.clone().all(|&slot| slot % p == 0 && slot >= p),
            "a run that is not page-aligned"
        );
        self.free_pages.extend(firsts.map(|&slot| slot / p));
    }

    /// The page that holds `slot`.
    pub fn page_of(&self, slot: Slot) -> u32 {
        slot / self.page_size
    }

    /// Number of pages (excluding the padding page).
    pub fn num_pages(&self) -> usize {
        self.num_pages as usize
    }

    /// Free page ids (for integrity checks).
    pub fn free_page_ids(&self) -> &[u32] {
        &self.free_pages
    }
}

/// Allocator of request slots: rows of the executor's `req_to_token` table.
#[derive(Debug, Clone)]
pub struct ReqSlotPool {
    size: u32,
    free: Vec<u32>,
}

impl ReqSlotPool {
    /// A pool of `size` request slots (`max_running_requests`).
    pub fn new(size: usize) -> Self {
        Self {
            size: size as u32,
            free: (0..size as u32).rev().collect(),
        }
    }

    /// Takes a free row, if any.
    pub fn alloc(&mut self) -> Option<u32> {
        self.free.pop()
    }

    /// Returns a row.
    pub fn free(&mut self, slot: u32) {
        debug_assert!(slot < self.size && !self.free.contains(&slot));
        self.free.push(slot);
    }

    /// Free rows.
    pub fn available(&self) -> usize {
        self.free.len()
    }

    /// Total rows.
    pub fn size(&self) -> usize {
        self.size as usize
    }

    /// Free row ids (for integrity checks).
    pub fn free_ids(&self) -> &[u32] {
        &self.free
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_come_out_ascending_and_skip_the_padding_page() {
        let mut pool = TokenPool::new(64, 16);
        assert_eq!(pool.capacity(), 64);
        assert_eq!(pool.kv_buffer_size(), 80);
        assert_eq!(pool.alloc_pages(2), Some(vec![16, 32]));
        assert_eq!(pool.available(), 32);
    }

    #[test]
    fn alloc_fails_without_taking_anything() {
        let mut pool = TokenPool::new(32, 16);
        assert!(pool.alloc_pages(3).is_none());
        assert_eq!(pool.available(), 32);
    }

    #[test]
    fn alloc_tokens_fills_pages_then_free_returns_them() {
        let mut pool = TokenPool::new(64, 4);
        let slots = pool.alloc_tokens(6).unwrap();
        assert_eq!(slots, vec![4, 5, 6, 7, 8, 9]);
        assert_eq!(pool.available(), 64 - 8);
        pool.free(&slots);
        assert_eq!(pool.available(), 64);
    }

    #[test]
    fn free_run_returns_what_free_does_for_page_aligned_runs() {
        let mut a = TokenPool::new(256, 16);
        let mut b = TokenPool::new(256, 16);
        let run = a.alloc_tokens(40).unwrap();
        b.alloc_tokens(40).unwrap();
        a.free(&run[16..]);
        b.free_run(&run[16..]);
        assert_eq!(a.free_page_ids(), b.free_page_ids());
    }

    #[test]
    fn page_size_one_is_token_granular() {
        let mut pool = TokenPool::new(10, 1);
        let a = pool.alloc_tokens(3).unwrap();
        assert_eq!(a, vec![1, 2, 3]);
        pool.free(&a[1..]);
        assert_eq!(pool.available(), 9);
    }

    #[test]
    fn req_slots_are_reused_after_free() {
        let mut pool = ReqSlotPool::new(2);
        let a = pool.alloc().unwrap();
        let b = pool.alloc().unwrap();
        assert_ne!(a, b);
        assert!(pool.alloc().is_none());
        pool.free(a);
        assert_eq!(pool.alloc(), Some(a));
    }
}
