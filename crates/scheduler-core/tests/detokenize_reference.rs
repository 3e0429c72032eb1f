//! The batched detokenizer against a naive reference that decodes each request's whole
//! output again after every token: the streamed deltas must concatenate to that text, cut
//! at the first stop string to appear (the earliest starting, the first listed among equal
//! starts), and the stop must be reported at the token that completed it.

use proptest::prelude::*;
use scheduler_core::{ByteTable, Detokenizer, StopMatch, TextOptions};

/// Bytes that make valid, split, truncated and invalid UTF-8 likely: ASCII, the pieces of
/// "é", "東" and "🎉", a stray continuation byte and bytes that never occur in UTF-8.
const BYTES: &[u8] = &[
    b'a', b'b', 0xC3, 0xA9, 0xE6, 0x9D, 0xB1, 0xF0, 0x9F, 0x8E, 0x89, 0x80, 0xFF, 0xC0,
];
/// Characters stop strings are made of (U+FFFD: invalid bytes' stand-in can be matched too).
const STOP_CHARS: &[char] = &['a', 'b', 'é', '東', '\u{FFFD}'];
const SPECIAL: u32 = 0;

/// The text of `bytes` as Python's incremental decoder gives it before the end: invalid
/// subparts replaced, an incomplete character at the end left out.
fn committed(bytes: &[u8]) -> String {
    let incomplete_end = bytes
        .utf8_chunks()
        .last()
        .map(|c| {
            !c.invalid().is_empty()
                && std::str::from_utf8(c.invalid())
                    .unwrap_err()
                    .error_len()
                    .is_none()
        })
        .unwrap_or(false);
    let mut text = String::from_utf8_lossy(bytes).into_owned();
    if incomplete_end {
        assert_eq!(text.pop(), Some('\u{FFFD}'));
    }
    text
}

/// The text of `tokens` and the stop string (index, token position) that ended it.
fn reference(
    table: &[Vec<u8>],
    tokens: &[u32],
    options: &TextOptions,
) -> (String, Option<(usize, usize)>) {
    let mut bytes = Vec::new();
    for (k, &t) in tokens.iter().enumerate() {
        if !(options.skip_special_tokens && t == SPECIAL) {
            bytes.extend_from_slice(&table[t as usize]);
        }
        let text = committed(&bytes);
        let mut best: Option<(usize, usize)> = None;
        for (i, s) in options.stop.iter().enumerate() {
            if let Some(at) = text.find(s.as_str()) {
                if best.is_none_or(|(b, _)| at < b) {
                    best = Some((at, i));
                }
            }
        }
        if let Some((at, i)) = best {
            let end = if options.no_stop_trim {
                at + options.stop[i].len()
            } else {
                at
            };
            return (text[..end].to_string(), Some((i, k)));
        }
    }
    (committed(&bytes), None)
}

fn token_strategy() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(prop::sample::select(BYTES), 0..4)
}

fn stop_strategy() -> impl Strategy<Value = Vec<String>> {
    let stop = prop::collection::vec(prop::sample::select(STOP_CHARS), 1..4)
        .prop_map(|c| c.into_iter().collect::<String>());
    prop::collection::vec(stop, 0..3)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn deltas_concatenate_to_the_reference_text_cut_at_the_first_stop(
        mut table in prop::collection::vec(token_strategy(), 2..12),
        requests in prop::collection::vec(
            (
                prop::collection::vec(prop::collection::vec(0u32..12, 0..3), 0..25),
                stop_strategy(),
                any::<bool>(),
                any::<bool>(),
            ),
            1..4,
        ),
    ) {
        table[SPECIAL as usize] = b"<s>".to_vec();
        let mut d = Detokenizer::new(ByteTable::new(&table, [SPECIAL]));
        let n = table.len() as u32;
        let mut live = Vec::new();
        for (steps, stop, skip, no_trim) in &requests {
            let options = TextOptions {
                stop: stop.clone(),
                skip_special_tokens: *skip,
                no_stop_trim: *no_trim,
                ..TextOptions::default()
            };
            let steps: Vec<Vec<u32>> = steps.iter().map(|s| s.iter().map(|t| t % n).collect()).collect();
            live.push((d.add(options.clone()), options, steps, String::new(), None::<(usize, usize)>));
        }
        // All requests step together, as the loop's steps go; each one's tokens in order.
        let longest = live.iter().map(|r| r.2.len()).max().unwrap_or(0);
        for s in 0..longest {
            let batch: Vec<(u64, Vec<u32>)> = live
                .iter()
                .map(|r| (r.0, r.2.get(s).cloned().unwrap_or_default()))
                .collect();
            let deltas = d.step(batch.iter().map(|(h, t)| (*h, t.as_slice()))).unwrap();
            for (r, delta) in live.iter_mut().zip(deltas) {
                r.3.push_str(&delta.text);
                if let Some(StopMatch { index, tokens }) = delta.stop {
                    prop_assert!(r.4.is_none(), "a second stop");
                    let before: usize = r.2[..s].iter().map(Vec::len).sum();
                    r.4 = Some((index, before + tokens - 1));
                }
            }
        }
        for (h, options, steps, mut text, stop) in live {
            text.push_str(&d.finish(h).unwrap());
            let tokens: Vec<u32> = steps.concat();
            let (want, want_stop) = reference(&table, &tokens, &options);
            prop_assert_eq!(&text, &want, "tokens {:?}, options {:?}", tokens, options);
            prop_assert_eq!(stop, want_stop);
            d.remove(h).unwrap();
        }
        prop_assert!(d.is_empty());
    }
}
