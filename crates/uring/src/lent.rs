//! [`Lent`]: bytes a device lends to a reply instead of copying them into
//! the request's buffer (a memory volume's read), sent from where they
//! are.
//!
//! A `Lent` owns a reference to the memory it shows (an `Arc` on the
//! device's region), never a bare address: the region stays allocated
//! while any reply holds it, whatever the device does meanwhile (a trim
//! that frees the region, the device dropped with its volume). What the
//! bytes may be changed by is the lender's rule; `MallocDev`'s is that
//! nothing changes them (a write to a lent region copies the region
//! first; docs/PER_IO.md, "Lent reads"). Safe code throughout: the lender
//! hands over shared, immutable memory.
//!
//! ```
//! use std::sync::Arc;
//! use lull_uring::Lent;
//! let region: Arc<Box<[u8]>> = Arc::new(vec![7u8; 64].into_boxed_slice());
//! let lent = Lent::new(region.clone(), 8, 16).expect("inside the region");
//! drop(region);
//! assert_eq!(lent.as_slice(), &[7u8; 16][..]);
//! assert!(Lent::new(Arc::new(vec![0u8; 4].into_boxed_slice()), 2, 3).is_none());
//! ```

use std::sync::Arc;

/// The memory a [`Lent`] shows part of: a region of bytes shared between
/// threads (a device's region is read by the reactors of every connection
/// of its volume). A thin pointer, so a completion carrying a loan stays
/// small.
pub type LentRegion = Arc<Box<[u8]>>;

/// `len` bytes at `at` of a region a device lent, held until dropped.
#[derive(Clone)]
pub struct Lent {
    region: LentRegion,
    at: usize,
    len: usize,
}

impl Lent {
    /// `len` bytes of `region` from `at`; `None` when they are not all
    /// inside it.
    pub fn new(region: LentRegion, at: usize, len: usize) -> Option<Lent> {
        let end = at.checked_add(len)?;
        if end > region.len() {
            return None;
        }
        Some(Lent { region, at, len })
    }

    /// The lent bytes.
    pub fn as_slice(&self) -> &[u8] {
        // Checked against the region's length in `new`; a region's length
        // never changes (it is shared and immutable).
        self.region
            .get(self.at..self.at + self.len)
            .unwrap_or_default()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl std::fmt::Debug for Lent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lent")
            .field("at", &self.at)
            .field("len", &self.len)
            .field("holders", &Arc::strong_count(&self.region))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_its_region_and_shows_only_its_range() {
        let region: Arc<Box<[u8]>> = Arc::new((0..=255u8).collect::<Vec<_>>().into_boxed_slice());
        let lent = Lent::new(region.clone(), 250, 6).expect("inside");
        assert_eq!(Arc::strong_count(&region), 2, "the loan holds the region");
        let weak = Arc::downgrade(&region);
        drop(region);
        assert_eq!(lent.as_slice(), &[250, 251, 252, 253, 254, 255]);
        assert!(weak.upgrade().is_some(), "kept alive by the loan");
        drop(lent);
        assert!(weak.upgrade().is_none(), "freed with the last loan");
        let small: LentRegion = Arc::new(vec![0u8; 4].into_boxed_slice());
        assert!(Lent::new(small.clone(), 4, 0).is_some());
        assert!(Lent::new(small.clone(), 4, 1).is_none());
        assert!(Lent::new(small, usize::MAX, 2).is_none());
    }
}
