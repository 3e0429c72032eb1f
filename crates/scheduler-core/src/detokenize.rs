//! Incremental detokenization of byte-level BPE output, every request of a step in one call.
//!
//! A byte-level BPE tokenizer (GPT-2, Llama 3, Qwen, SmolLM2) maps each token to fixed bytes,
//! so a request's text is the UTF-8 decoding of its tokens' bytes laid end to end. The
//! [`Detokenizer`] keeps, per request, only what a later token can still change:
//!
//! - up to 3 bytes of a character split across tokens;
//! - the text not yet released: at most the longest stop string less one character, which a
//!   later token could complete into a stop string (and so cut off).
//!
//! A step therefore costs the same however long the outputs already are.
//!
//! The text is exactly Python's: invalid UTF-8 becomes one U+FFFD per maximal ill-formed
//! subpart, as `bytes.decode("utf-8", "replace")` and its incremental decoder do (Rust's
//! `from_utf8` reports the same subparts), and an incomplete character at the end of a
//! request is dropped. Stop strings are searched in the characters not yet released; the
//! one starting first wins, the first listed among equal starts; lengths count characters
//! (code points), as Python's `len` does.

/// Opaque id of one request's state in a [`Detokenizer`]: its slot in the low 32 bits, the
/// slot's generation in the high ones (a handle outlives its request only as an error).
pub type TextHandle = u64;

/// The bytes of every token of a byte-level BPE tokenizer, and which ids are special.
#[derive(Debug, Clone)]
pub struct ByteTable {
    /// Every token's bytes laid end to end; token `i` is `bytes[offsets[i]..offsets[i + 1]]`.
    bytes: Vec<u8>,
    offsets: Vec<usize>,
    /// Whether token `i`'s bytes are valid UTF-8 on their own (most are: they need no
    /// decoding when no partial character waits before them).
    utf8: Vec<bool>,
    special: Vec<bool>,
}

impl ByteTable {
    /// The table of `tokens` (token `i`'s bytes at index `i`); ids in `special` are dropped
    /// from the text of requests that skip special tokens. Special ids beyond the table are
    /// ignored.
    pub fn new<T: AsRef<[u8]>>(tokens: &[T], special: impl IntoIterator<Item = u32>) -> Self {
        let mut bytes = Vec::with_capacity(tokens.iter().map(|t| t.as_ref().len()).sum());
        let mut offsets = Vec::with_capacity(tokens.len() + 1);
        offsets.push(0);
        for t in tokens {
            bytes.extend_from_slice(t.as_ref());
            offsets.push(bytes.len());
        }
        let utf8 = tokens
            .iter()
            .map(|t| std::str::from_utf8(t.as_ref()).is_ok())
            .collect();
        let mut is_special = vec![false; tokens.len()];
        for id in special {
            if let Some(s) = is_special.get_mut(id as usize) {
                *s = true;
            }
        }
        Self {
            bytes,
            offsets,
            utf8,
            special: is_special,
        }
    }

    /// Tokens in the table.
    pub fn len(&self) -> usize {
        self.special.len()
    }

    /// Whether the table has no tokens.
    pub fn is_empty(&self) -> bool {
        self.special.is_empty()
    }

    /// The bytes of `token`; None beyond the table (such an id has no text, as in the
    /// tokenizer's own `decode`).
    pub fn bytes(&self, token: u32) -> Option<&[u8]> {
        let i = token as usize;
        (i < self.len()).then(|| &self.bytes[self.offsets[i]..self.offsets[i + 1]])
    }

    /// The text of `token` when its bytes are valid UTF-8 on their own.
    pub fn str(&self, token: u32) -> Option<&str> {
        let i = token as usize;
        if !*self.utf8.get(i)? {
            return None;
        }
        let bytes = &self.bytes[self.offsets[i]..self.offsets[i + 1]];
        // SAFETY: `utf8[i]` records that `from_utf8` accepted these bytes.
        Some(unsafe { std::str::from_utf8_unchecked(bytes) })
    }

    /// Whether `token` is a special token.
    pub fn is_special(&self, token: u32) -> bool {
        self.special.get(token as usize).copied().unwrap_or(false)
    }
}

/// How one request's text is made: its stop strings and decoding options.
#[derive(Debug, Clone, Default)]
pub struct TextOptions {
    /// Stop strings (empty ones are ignored): the text ends where the first one starts.
    pub stop: Vec<String>,
    /// Leave special tokens out of the text.
    pub skip_special_tokens: bool,
    /// Keep the matched stop string at the end of the text.
    pub no_stop_trim: bool,
    /// Characters held back beyond what `stop` needs: the length of a stop string that no
    /// text can contain but that the caller still counts (Python's lone surrogates).
    pub extra_holdback: usize,
}

/// A stop string reached: it was `stop[index]`, completed by the request's `tokens`-th token
/// of the step (1-based; the tokens after it are not part of the text).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StopMatch {
    pub index: usize,
    pub tokens: usize,
}

/// What one request's tokens of a step made: the newly final text, and the stop string
/// that ended it, if one did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Delta {
    pub text: String,
    pub stop: Option<StopMatch>,
}

/// Errors of the [`Detokenizer`]'s callers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DetokenizeError {
    /// The handle names no live request (never added, or removed).
    UnknownHandle(TextHandle),
}

impl std::fmt::Display for DetokenizeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DetokenizeError::UnknownHandle(h) => write!(f, "no request has text handle {h}"),
        }
    }
}

impl std::error::Error for DetokenizeError {}

/// One request's text state between steps.
#[derive(Debug, Clone)]
struct RequestText {
    stop: Vec<String>,
    /// Characters that must stay unreleased: the longest stop string's length less one.
    holdback: usize,
    skip_special_tokens: bool,
    no_stop_trim: bool,
    /// Bytes of a character not yet complete (at most 3).
    partial: [u8; 3],
    partial_len: u8,
    /// Decoded text not yet released (at most `holdback` characters between steps).
    held: String,
    /// Index into `stop` of the string that ended the text.
    matched: Option<usize>,
}

impl RequestText {
    fn new(options: TextOptions) -> Self {
        let stop = options.stop;
        let longest = stop.iter().map(|s| s.chars().count()).max().unwrap_or(0);
        let holdback = longest.max(options.extra_holdback).saturating_sub(1);
        Self {
            stop,
            holdback,
            skip_special_tokens: options.skip_special_tokens,
            no_stop_trim: options.no_stop_trim,
            partial: [0; 3],
            partial_len: 0,
            held: String::new(),
            matched: None,
        }
    }

    /// Accounts `tokens`, appending the text that became final to `out`.
    fn push(
        &mut self,
        table: &ByteTable,
        tokens: impl IntoIterator<Item = u32>,
        scratch: &mut Vec<u8>,
        out: &mut String,
    ) -> Option<StopMatch> {
        for (i, token) in tokens.into_iter().enumerate() {
            if self.matched.is_some() {
                break;
            }
            if self.skip_special_tokens && table.is_special(token) {
                continue;
            }
            let before = self.held.len();
            match table.str(token) {
                Some(text) if self.partial_len == 0 => self.held.push_str(text),
                _ => match table.bytes(token) {
                    Some(bytes) => self.decode(bytes, scratch),
                    None => continue,
                },
            }
            if self.held.len() == before {
                continue; // no text, or only part of a character so far
            }
            if let Some(index) = self.find_stop() {
                out.push_str(&self.held);
                self.held.clear();
                self.matched = Some(index);
                return Some(StopMatch {
                    index,
                    tokens: i + 1,
                });
            }
            self.release(out);
        }
        None
    }

    /// Appends the UTF-8 decoding of `bytes` (after the partial character held from before)
    /// to `held`, and holds back a new incomplete character at the end.
    fn decode(&mut self, bytes: &[u8], scratch: &mut Vec<u8>) {
        if self.partial_len == 0 {
            decode_lossy(
                bytes,
                &mut self.held,
                &mut self.partial,
                &mut self.partial_len,
            );
            return;
        }
        scratch.clear();
        scratch.extend_from_slice(&self.partial[..self.partial_len as usize]);
        scratch.extend_from_slice(bytes);
        self.partial_len = 0;
        decode_lossy(
            scratch,
            &mut self.held,
            &mut self.partial,
            &mut self.partial_len,
        );
    }

    /// The stop string that starts first in `held` (the first listed among equal starts);
    /// cuts `held` after it (or before it, trimming it).
    ///
    /// Searching all of `held` is searching from `holdback` characters before the new text:
    /// every earlier character was released because no stop string could start there.
    fn find_stop(&mut self) -> Option<usize> {
        let mut best: Option<(usize, usize)> = None;
        for (index, s) in self.stop.iter().enumerate() {
            if s.is_empty() {
                continue;
            }
            if let Some(at) = self.held.find(s.as_str()) {
                if best.is_none_or(|(b, _)| at < b) {
                    best = Some((at, index));
                }
            }
        }
        let (at, index) = best?;
        let end = if self.no_stop_trim {
            at + self.stop[index].len()
        } else {
            at
        };
        self.held.truncate(end);
        Some(index)
    }

    /// Moves all but the last `holdback` characters of `held` to `out`.
    fn release(&mut self, out: &mut String) {
        let split = if self.holdback == 0 {
            self.held.len()
        } else {
            match self.held.char_indices().nth_back(self.holdback - 1) {
                Some((at, _)) => at,
                None => return, // shorter than the hold-back
            }
        };
        out.push_str(&self.held[..split]);
        self.held.drain(..split);
    }

    /// The held-back text, released because the request is over; an incomplete character
    /// at the end is dropped.
    fn finish(&mut self) -> String {
        self.partial_len = 0;
        std::mem::take(&mut self.held)
    }
}

/// Appends `bytes` decoded as UTF-8 to `out`, one U+FFFD per maximal ill-formed subpart; an
/// incomplete character at the end goes to `partial` instead (`partial_len` must be 0).
fn decode_lossy(mut bytes: &[u8], out: &mut String, partial: &mut [u8; 3], partial_len: &mut u8) {
    loop {
        match std::str::from_utf8(bytes) {
            Ok(s) => {
                out.push_str(s);
                return;
            }
            Err(e) => {
                let (valid, rest) = bytes.split_at(e.valid_up_to());
                // SAFETY: `from_utf8` validated `bytes[..valid_up_to]`.
                out.push_str(unsafe { std::str::from_utf8_unchecked(valid) });
                match e.error_len() {
                    Some(n) => {
                        out.push(char::REPLACEMENT_CHARACTER);
                        bytes = &rest[n..];
                    }
                    None => {
                        // Only a prefix of a valid sequence ends the input: at most 3 bytes.
                        partial[..rest.len()].copy_from_slice(rest);
                        *partial_len = rest.len() as u8;
                        return;
                    }
                }
            }
        }
    }
}

/// Every running request's incremental text, over one [`ByteTable`].
///
/// [`add`](Self::add) starts a request and returns its handle; [`step`](Self::step) takes
/// one step's tokens of any number of requests and returns each one's newly final text, and
/// the stop string that ended it; [`finish`](Self::finish) returns what is held back once a
/// request is over; [`remove`](Self::remove) forgets it. A request whose text reached a stop
/// string takes no more text.
#[derive(Debug, Clone)]
pub struct Detokenizer {
    table: ByteTable,
    slots: Vec<Slot>,
    free: Vec<u32>,
    /// Joins a held partial character with the next token's bytes.
    scratch: Vec<u8>,
}

#[derive(Debug, Clone)]
struct Slot {
    generation: u32,
    text: Option<RequestText>,
}

impl Detokenizer {
    /// A detokenizer with no requests yet.
    pub fn new(table: ByteTable) -> Self {
        Self {
            table,
            slots: Vec::new(),
            free: Vec::new(),
            scratch: Vec::new(),
        }
    }

    /// The token table.
    pub fn table(&self) -> &ByteTable {
        &self.table
    }

    /// Requests added and not yet removed.
    pub fn len(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Whether no request is live.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Starts a request's text; returns its handle.
    pub fn add(&mut self, options: TextOptions) -> TextHandle {
        let text = Some(RequestText::new(options));
        let index = match self.free.pop() {
            Some(i) => {
                self.slots[i as usize].text = text;
                i
            }
            None => {
                self.slots.push(Slot {
                    generation: 0,
                    text,
                });
                (self.slots.len() - 1) as u32
            }
        };
        handle(index, self.slots[index as usize].generation)
    }

    /// Whether `h` names a live request.
    pub fn contains(&self, h: TextHandle) -> bool {
        self.slot(h).is_ok()
    }

    fn slot(&self, h: TextHandle) -> Result<usize, DetokenizeError> {
        let index = (h & u32::MAX as u64) as usize;
        match self.slots.get(index) {
            Some(s) if s.text.is_some() && handle(index as u32, s.generation) == h => Ok(index),
            _ => Err(DetokenizeError::UnknownHandle(h)),
        }
    }

    /// One request's tokens: appends the text that became final to `out`; returns the stop
    /// string that ended the text, if one did here.
    pub fn push(
        &mut self,
        h: TextHandle,
        tokens: impl IntoIterator<Item = u32>,
        out: &mut String,
    ) -> Result<Option<StopMatch>, DetokenizeError> {
        let index = self.slot(h)?;
        let text = self.slots[index].text.as_mut().expect("checked live");
        Ok(text.push(&self.table, tokens, &mut self.scratch, out))
    }

    /// One step: each `(handle, tokens)`'s delta, in order. Checks every handle before
    /// taking any token, so an unknown one changes nothing.
    pub fn step<'a>(
        &mut self,
        batch: impl IntoIterator<Item = (TextHandle, &'a [u32])> + Clone,
    ) -> Result<Vec<Delta>, DetokenizeError> {
        for (h, _) in batch.clone() {
            self.slot(h)?;
        }
        let mut deltas = Vec::new();
        for (h, tokens) in batch {
            let mut delta = Delta::default();
            delta.stop = self.push(h, tokens.iter().copied(), &mut delta.text)?;
            deltas.push(delta);
        }
        Ok(deltas)
    }

    /// The stop string that ended a request's text, if one did.
    pub fn matched_stop(&self, h: TextHandle) -> Result<Option<&str>, DetokenizeError> {
        let text = self.slots[self.slot(h)?]
            .text
            .as_ref()
            .expect("checked live");
        Ok(text.matched.map(|i| text.stop[i].as_str()))
    }

    /// The rest of a request's text once it is over: what was held back for stop strings
    /// ("" after a stop string, whose text was released at once). An incomplete character
    /// at the very end is dropped rather than shown as U+FFFD. The request takes no more
    /// text afterwards (until removed, its handle stays valid).
    pub fn finish(&mut self, h: TextHandle) -> Result<String, DetokenizeError> {
        let index = self.slot(h)?;
        Ok(self.slots[index]
            .text
            .as_mut()
            .expect("checked live")
            .finish())
    }

    /// Forgets a request; its handle becomes unknown.
    pub fn remove(&mut self, h: TextHandle) -> Result<(), DetokenizeError> {
        let index = self.slot(h)?;
        let slot = &mut self.slots[index];
        slot.text = None;
        slot.generation = slot.generation.wrapping_add(1);
        self.free.push(index as u32);
        Ok(())
    }
}

fn handle(index: u32, generation: u32) -> TextHandle {
    (generation as u64) << 32 | index as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tokens 0..=255 are the single bytes, then a few multi-byte ones; 300 and 301 special.
    fn table() -> ByteTable {
        let mut tokens: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        tokens.push("東京".as_bytes().to_vec()); // 256
        tokens.push(b"Paris".to_vec()); // 257
        tokens.push(b". It".to_vec()); // 258
        tokens.push(vec![0xF0, 0x9F]); // 259: the first half of an emoji
        tokens.push(vec![0x8E, 0x89]); // 260: its second half (U+1F389)
        while tokens.len() < 300 {
            tokens.push(b"?".to_vec());
        }
        tokens.push(b"<|im_end|>".to_vec()); // 300
        tokens.push(b"<s>".to_vec()); // 301
        ByteTable::new(&tokens, [300, 301, 9999])
    }

    fn ids(text: &str) -> Vec<u32> {
        text.bytes().map(u32::from).collect()
    }

    fn options(stop: &[&str]) -> TextOptions {
        TextOptions {
            stop: stop.iter().map(|s| s.to_string()).collect(),
            skip_special_tokens: true,
            ..TextOptions::default()
        }
    }

    /// The text of `tokens` fed one per step, the rest at the end; and the stop match.
    fn stream(
        d: &mut Detokenizer,
        options: TextOptions,
        tokens: &[u32],
    ) -> (Vec<String>, Option<StopMatch>) {
        let h = d.add(options);
        let mut deltas = Vec::new();
        let mut stop = None;
        for &t in tokens {
            let mut delta = d.step([(h, &[t][..])]).unwrap().remove(0);
            deltas.push(std::mem::take(&mut delta.text));
            if delta.stop.is_some() {
                stop = delta.stop;
                break;
            }
        }
        deltas.push(d.finish(h).unwrap());
        d.remove(h).unwrap();
        (deltas, stop)
    }

    #[test]
    fn a_character_split_across_tokens_comes_out_whole_once_complete() {
        let mut d = Detokenizer::new(table());
        let (deltas, _) = stream(&mut d, options(&[]), &[259, 260, 256]);
        assert_eq!(deltas, ["", "🎉", "東京", ""]);
        let bytes: Vec<u32> = "日本".bytes().map(u32::from).collect();
        let (deltas, _) = stream(&mut d, options(&[]), &bytes);
        assert_eq!(deltas, ["", "", "日", "", "", "本", ""]);
    }

    #[test]
    fn invalid_utf8_becomes_one_replacement_per_maximal_subpart_as_python_does() {
        let mut d = Detokenizer::new(table());
        // b"\xe6\x9dA\x80\xf0\x80\xed\xa0\x80" .decode("utf-8", "replace") in Python:
        // '\ufffdA\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd'
        let bytes = [0xE6, 0x9D, b'A', 0x80, 0xF0, 0x80, 0xED, 0xA0, 0x80];
        let tokens: Vec<u32> = bytes.iter().map(|&b| u32::from(b)).collect();
        let (deltas, _) = stream(&mut d, options(&[]), &tokens);
        assert_eq!(
            deltas.concat(),
            "\u{FFFD}A\u{FFFD}\u{FFFD}\u{FFFD}\u{FFFD}\u{FFFD}\u{FFFD}"
        );
    }

    #[test]
    fn an_incomplete_character_at_the_end_is_dropped() {
        let mut d = Detokenizer::new(table());
        let (deltas, _) = stream(&mut d, options(&[]), &[u32::from(b'a'), 259]);
        assert_eq!(deltas.concat(), "a");
    }

    #[test]
    fn special_tokens_are_skipped_or_kept_as_asked() {
        let mut d = Detokenizer::new(table());
        let tokens = [u32::from(b'x'), 300, 301, 259, 300];
        let (deltas, _) = stream(&mut d, options(&[]), &tokens);
        assert_eq!(deltas.concat(), "x");
        let keep = TextOptions {
            skip_special_tokens: false,
            ..options(&[])
        };
        // The half emoji before a special token is invalid by then: U+FFFD, as Python's.
        let (deltas, _) = stream(&mut d, keep, &tokens);
        assert_eq!(deltas.concat(), "x<|im_end|><s>\u{FFFD}<|im_end|>");
    }

    #[test]
    fn ids_beyond_the_table_have_no_text() {
        let mut d = Detokenizer::new(table());
        let (deltas, _) = stream(
            &mut d,
            options(&[]),
            &[u32::from(b'a'), 5000, u32::from(b'b')],
        );
        assert_eq!(deltas.concat(), "ab");
    }

    #[test]
    fn a_stop_string_across_tokens_ends_the_text_before_it() {
        let mut d = Detokenizer::new(table());
        let mut tokens = ids("We saw ");
        tokens.extend([257, 258, u32::from(b'!')]);
        let (deltas, stop) = stream(&mut d, options(&["Paris. It", "never"]), &tokens);
        assert_eq!(deltas.concat(), "We saw ");
        assert!(deltas.iter().all(|d| !d.contains('P')));
        assert_eq!(
            stop,
            Some(StopMatch {
                index: 0,
                tokens: 1
            })
        );
    }

    #[test]
    fn no_stop_trim_keeps_the_stop_string() {
        let mut d = Detokenizer::new(table());
        let opts = TextOptions {
            no_stop_trim: true,
            ..options(&[" three"])
        };
        let (deltas, stop) = stream(&mut d, opts, &ids("one two three four"));
        assert_eq!(deltas.concat(), "one two three");
        assert_eq!(
            stop,
            Some(StopMatch {
                index: 0,
                tokens: 1
            })
        );
    }

    #[test]
    fn text_that_could_start_a_stop_string_is_held_back_then_released() {
        let mut d = Detokenizer::new(table());
        let h = d.add(options(&["Paris. It"]));
        let mut released = String::new();
        for t in ids("We went to Paris") {
            released += &d.step([(h, &[t][..])]).unwrap()[0].text;
        }
        // Eight characters held back: the longest stop string less one.
        assert_eq!(released, "We went ");
        for t in ids(" and Rome.") {
            released += &d.step([(h, &[t][..])]).unwrap()[0].text;
        }
        released += &d.finish(h).unwrap();
        assert_eq!(released, "We went to Paris and Rome.");
        assert_eq!(d.matched_stop(h).unwrap(), None);
    }

    #[test]
    fn hold_back_counts_characters_not_bytes() {
        let mut d = Detokenizer::new(table());
        let h = d.add(options(&["ab"]));
        let released = &d.step([(h, &[256][..])]).unwrap()[0].text;
        assert_eq!(released, "東"); // one character held back
    }

    #[test]
    fn the_earliest_stop_string_wins_and_the_first_listed_among_ties() {
        let mut d = Detokenizer::new(table());
        let opts = options(&[" delta", " beta gamma", " gamma"]);
        let (deltas, stop) = stream(&mut d, opts, &ids("alpha beta gamma delta"));
        assert_eq!(deltas.concat(), "alpha");
        assert_eq!(stop.map(|s| s.index), Some(1));
        // All three start at "P" of the one token "Paris": the first listed wins.
        let h = d.add(TextOptions {
            no_stop_trim: true,
            ..options(&["Pari", "Paris", "P"])
        });
        let delta = d
            .step([(h, &[u32::from(b'x'), 257, 258][..])])
            .unwrap()
            .remove(0);
        assert_eq!(delta.text, "xPari");
        assert_eq!(
            delta.stop,
            Some(StopMatch {
                index: 0,
                tokens: 2
            })
        );
        assert_eq!(d.matched_stop(h).unwrap(), Some("Pari"));
    }

    #[test]
    fn empty_stop_strings_are_ignored_and_indices_stay_the_callers() {
        let mut d = Detokenizer::new(table());
        let h = d.add(options(&["", "b"]));
        let delta = d.step([(h, &ids("ab")[..])]).unwrap().remove(0);
        assert_eq!(delta.text, "a");
        assert_eq!(
            delta.stop,
            Some(StopMatch {
                index: 1,
                tokens: 2
            })
        );
    }

    #[test]
    fn tokens_after_a_stop_string_are_ignored() {
        let mut d = Detokenizer::new(table());
        let h = d.add(options(&["b"]));
        let delta = d.step([(h, &ids("abcd")[..])]).unwrap().remove(0);
        assert_eq!(
            (delta.text.as_str(), delta.stop),
            (
                "a",
                Some(StopMatch {
                    index: 0,
                    tokens: 2
                })
            )
        );
        assert_eq!(d.step([(h, &ids("ef")[..])]).unwrap()[0], Delta::default());
        assert_eq!(d.finish(h).unwrap(), "");
    }

    #[test]
    fn one_step_serves_many_requests_independently() {
        let mut d = Detokenizer::new(table());
        let a = d.add(options(&[]));
        let b = d.add(options(&["!"]));
        let deltas = d.step([(a, &[259][..]), (b, &ids("hi!")[..])]).unwrap();
        assert_eq!(deltas[0], Delta::default());
        assert_eq!(deltas[1].text, "hi");
        let deltas = d.step([(a, &[260][..])]).unwrap();
        assert_eq!(deltas[0].text, "🎉");
    }

    #[test]
    fn an_unknown_handle_fails_the_step_before_any_token_is_taken() {
        let mut d = Detokenizer::new(table());
        let a = d.add(options(&[]));
        let b = d.add(options(&[]));
        d.remove(b).unwrap();
        let c = d.add(options(&[])); // reuses b's slot with a new generation
        assert_ne!(b, c);
        let err = d.step([(a, &[259][..]), (b, &[260][..])]).unwrap_err();
        assert_eq!(err, DetokenizeError::UnknownHandle(b));
        assert_eq!(d.step([(a, &ids("x")[..])]).unwrap()[0].text, "x");
        assert!(d.finish(b).is_err() && d.remove(b).is_err());
        assert_eq!(d.len(), 2);
        d.remove(a).unwrap();
        d.remove(c).unwrap();
        assert!(d.is_empty());
    }

    #[test]
    fn held_text_stays_bounded_however_long_the_output() {
        let mut d = Detokenizer::new(table());
        let h = d.add(options(&["zzzz"]));
        let mut total = 0;
        for _ in 0..10_000 {
            total += d.step([(h, &[256][..])]).unwrap()[0].text.chars().count();
            let held = &d.slots[(h & u32::MAX as u64) as usize]
                .text
                .as_ref()
                .unwrap()
                .held;
            assert!(held.chars().count() <= 3);
        }
        assert_eq!(total + d.finish(h).unwrap().chars().count(), 20_000);
    }
}
