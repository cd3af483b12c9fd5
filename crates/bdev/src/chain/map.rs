//! The allocation maps of a chain: one bit per block per layer (which
//! blocks a layer holds) and one byte per block for the chain (which layer
//! a read of the block goes to), shared by every channel of the device.
//!
//! Relaxed atomics would do for the bits themselves; a write's completion
//! publishes its bits with `Release` before the completion is handed out,
//! and a read looks them up with `Acquire`, so a read issued after a write
//! was acknowledged finds the layer the write went to.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

use super::CHAIN_BLOCK_BYTES;

/// Blocks of `size_bytes`, the last one partial.
pub(crate) fn blocks_of(size_bytes: u64) -> u64 {
    size_bytes.div_ceil(CHAIN_BLOCK_BYTES)
}

/// The blocks `[offset, offset + len)` touches: first and one past the last.
pub(crate) fn block_span(offset: u64, len: u64) -> (u64, u64) {
    (
        offset / CHAIN_BLOCK_BYTES,
        (offset + len).div_ceil(CHAIN_BLOCK_BYTES),
    )
}

/// One bit per block: the blocks one layer holds.
#[derive(Debug)]
pub(crate) struct Bitmap {
    words: Box<[AtomicU64]>,
    blocks: u64,
}

impl Bitmap {
    pub(crate) fn new(blocks: u64) -> Bitmap {
        let words = (0..blocks.div_ceil(64))
            .map(|_| AtomicU64::new(0))
            .collect();
        Bitmap { words, blocks }
    }

    pub(crate) fn get(&self, block: u64) -> bool {
        match self.words.get((block / 64) as usize) {
            Some(w) => w.load(Ordering::Acquire) & (1 << (block % 64)) != 0,
            None => false,
        }
    }

    /// The word holding blocks `64 * i .. 64 * i + 64`.
    pub(crate) fn word(&self, i: u64) -> u64 {
        self.words
            .get(i as usize)
            .map_or(0, |w| w.load(Ordering::Acquire))
    }

    /// Sets the bits of blocks `[first, end)`.
    pub(crate) fn set_range(&self, first: u64, end: u64) {
        self.update_range(first, end, |w, m| {
            w.fetch_or(m, Ordering::Release);
        });
    }

    fn update_range(&self, first: u64, end: u64, f: impl Fn(&AtomicU64, u64)) {
        let end = end.min(self.blocks);
        let mut b = first;
        while b < end {
            let bit = b % 64;
            let n = (64 - bit).min(end - b);
            let mask = if n == 64 {
                u64::MAX
            } else {
                ((1u64 << n) - 1) << bit
            };
            f(&self.words[(b / 64) as usize], mask);
            b += n;
        }
    }

    /// A copy with room for `blocks` blocks (at least its own), the new
    /// ones not held. For a chain that grows: nothing may set bits in
    /// this one meanwhile (the chain is quiesced, no merge runs).
    pub(crate) fn grown(&self, blocks: u64) -> Bitmap {
        let out = Bitmap::new(blocks.max(self.blocks));
        for (i, w) in self.words.iter().enumerate() {
            out.words[i].store(w.load(Ordering::Acquire), Ordering::Relaxed);
        }
        out
    }

    /// Blocks it has a bit for.
    pub(crate) fn blocks(&self) -> u64 {
        self.blocks
    }

    /// Blocks held.
    pub(crate) fn count(&self) -> u64 {
        self.words
            .iter()
            .map(|w| u64::from(w.load(Ordering::Relaxed).count_ones()))
            .sum()
    }

    /// Whether any block of `[first, end)` is held.
    pub(crate) fn any_in(&self, first: u64, end: u64) -> bool {
        (first..end.min(self.blocks)).any(|b| self.get(b))
    }
}

/// One byte per block: 0 when no layer holds the block (it reads as
/// zeros), else one more than the index of the topmost layer holding it.
/// The byte caps a chain at 255 layers; `MAX_CHAIN_LAYERS` is lower.
#[derive(Debug)]
pub(crate) struct TopMap {
    slots: Box<[AtomicU8]>,
}

impl TopMap {
    /// The map of `layers` (bottom first): for each block, the topmost
    /// layer whose bitmap has it.
    pub(crate) fn build(blocks: u64, layers: &[&Bitmap]) -> TopMap {
        let slots: Box<[AtomicU8]> = (0..blocks).map(|_| AtomicU8::new(0)).collect();
        for (i, map) in layers.iter().enumerate() {
            let v = u8::try_from(i + 1).unwrap_or(u8::MAX);
            for w in 0..blocks.div_ceil(64) {
                let mut bits = map.word(w);
                while bits != 0 {
                    let b = w * 64 + u64::from(bits.trailing_zeros());
                    bits &= bits - 1;
                    if let Some(s) = slots.get(b as usize) {
                        s.store(v, Ordering::Relaxed);
                    }
                }
            }
        }
        TopMap { slots }
    }

    /// 0 (no layer) or the topmost holder's index + 1.
    pub(crate) fn get(&self, block: u64) -> u8 {
        self.slots
            .get(block as usize)
            .map_or(0, |s| s.load(Ordering::Acquire))
    }

    pub(crate) fn set_range(&self, first: u64, end: u64, value: u8) {
        for s in self.slots.iter().take(end as usize).skip(first as usize) {
            s.store(value, Ordering::Release);
        }
    }

    /// Sets `block` to `to` if it is `from` (a merge moving a block up
    /// one layer leaves blocks a later write moved higher alone).
    pub(crate) fn replace(&self, block: u64, from: u8, to: u8) {
        if let Some(s) = self.slots.get(block as usize) {
            let _ = s.compare_exchange(from, to, Ordering::AcqRel, Ordering::Relaxed);
        }
    }

    pub(crate) fn bytes(&self) -> usize {
        self.slots.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bitmap_ranges_cross_words() {
        let m = Bitmap::new(200);
        m.set_range(60, 130);
        assert!(!m.get(59) && m.get(60) && m.get(129) && !m.get(130));
        assert_eq!(m.count(), 70);
        m.set_range(0, 1000);
        assert_eq!(m.count(), 200, "clamped to the map");
        assert!(m.any_in(199, 300) && !Bitmap::new(10).any_in(0, 10));
        let g = m.grown(300);
        assert_eq!(
            (g.blocks(), g.count()),
            (300, 200),
            "bits kept, new blocks free"
        );
        g.set_range(250, 260);
        assert!(g.get(255) && !m.get(255));
    }

    #[test]
    fn top_map_takes_the_topmost_holder() {
        let a = Bitmap::new(100);
        let b = Bitmap::new(100);
        a.set_range(0, 50);
        b.set_range(40, 60);
        let t = TopMap::build(100, &[&a, &b]);
        assert_eq!((t.get(0), t.get(45), t.get(55), t.get(70)), (1, 2, 2, 0));
        t.replace(0, 1, 2);
        t.replace(45, 1, 3);
        assert_eq!((t.get(0), t.get(45)), (2, 2));
        assert_eq!(block_span(4095, 2), (0, 2));
        assert_eq!(blocks_of(4097), 2);
    }
}
