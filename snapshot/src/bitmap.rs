//! Page bitmaps in the KVM_GET_DIRTY_LOG layout: `u64` words, bit `i % 64` of word
//! `i / 64` stands for page `i`.

/// A fixed-size bitmap of pages.
#[derive(Clone, PartialEq, Eq)]
pub struct PageBitmap {
    words: Vec<u64>,
    pages: u64,
}

impl std::fmt::Debug for PageBitmap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PageBitmap({} of {} pages set)",
            self.count_ones(),
            self.pages
        )
    }
}

/// Words needed for `pages` bits.
pub fn words_for(pages: u64) -> u64 {
    pages.div_ceil(64)
}

impl PageBitmap {
    /// An all-clear bitmap of `pages` pages.
    pub fn new(pages: u64) -> PageBitmap {
        PageBitmap {
            words: vec![0; words_for(pages) as usize],
            pages,
        }
    }

    /// Build from words (KVM layout). Bits at or past `pages` are ignored and cleared.
    /// Returns `None` if `words` is too short for `pages`.
    pub fn from_words(mut words: Vec<u64>, pages: u64) -> Option<PageBitmap> {
        let need = words_for(pages) as usize;
        if words.len() < need {
            return None;
        }
        words.truncate(need);
        let tail = pages % 64;
        if tail != 0 {
            if let Some(last) = words.last_mut() {
                *last &= (1u64 << tail) - 1;
            }
        }
        Some(PageBitmap { words, pages })
    }

    /// Number of pages covered.
    pub fn len(&self) -> u64 {
        self.pages
    }

    /// Whether the bitmap covers no page.
    pub fn is_empty(&self) -> bool {
        self.pages == 0
    }

    /// The words (KVM layout).
    pub fn words(&self) -> &[u64] {
        &self.words
    }

    /// Whether page `i` is set (false past the end).
    pub fn get(&self, i: u64) -> bool {
        i < self.pages && self.words[(i / 64) as usize] & (1u64 << (i % 64)) != 0
    }

    /// Set page `i` (ignored past the end).
    pub fn set(&mut self, i: u64) {
        if i < self.pages {
            self.words[(i / 64) as usize] |= 1u64 << (i % 64);
        }
    }

    /// Clear page `i` (ignored past the end).
    pub fn clear(&mut self, i: u64) {
        if i < self.pages {
            self.words[(i / 64) as usize] &= !(1u64 << (i % 64));
        }
    }

    /// Set pages `[start, start + n)` (clipped to the end).
    pub fn set_range(&mut self, start: u64, n: u64) {
        let end = start.saturating_add(n).min(self.pages);
        for i in start..end {
            self.set(i);
        }
    }

    /// Number of set pages.
    pub fn count_ones(&self) -> u64 {
        self.words.iter().map(|w| u64::from(w.count_ones())).sum()
    }

    /// Maximal runs of set pages, as `(first_page, count)`, in ascending order.
    pub fn runs(&self) -> Runs<'_> {
        Runs { bm: self, pos: 0 }
    }

    /// Index of the first set page at or after `from`.
    pub fn next_set(&self, from: u64) -> Option<u64> {
        self.next_with(from, false)
    }

    /// Index of the first clear page at or after `from`.
    pub fn next_clear(&self, from: u64) -> Option<u64> {
        self.next_with(from, true)
    }

    fn next_with(&self, from: u64, invert: bool) -> Option<u64> {
        if from >= self.pages {
            return None;
        }
        let mut wi = (from / 64) as usize;
        let mut w = self.words[wi] ^ if invert { !0 } else { 0 };
        w &= !0u64 << (from % 64);
        loop {
            if w != 0 {
                let i = wi as u64 * 64 + u64::from(w.trailing_zeros());
                return (i < self.pages).then_some(i);
            }
            wi += 1;
            if wi >= self.words.len() {
                return None;
            }
            w = self.words[wi] ^ if invert { !0 } else { 0 };
        }
    }
}

/// Iterator over runs of set pages; see [`PageBitmap::runs`].
pub struct Runs<'a> {
    bm: &'a PageBitmap,
    pos: u64,
}

impl Iterator for Runs<'_> {
    type Item = (u64, u64);

    fn next(&mut self) -> Option<(u64, u64)> {
        let start = self.bm.next_set(self.pos)?;
        let end = self.bm.next_clear(start).unwrap_or(self.bm.pages);
        self.pos = end;
        Some((start, end - start))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_get_runs() {
        let mut b = PageBitmap::new(200);
        for i in [0, 1, 2, 63, 64, 65, 130, 199] {
            b.set(i);
        }
        b.set(500); // ignored
        assert!(b.get(64) && !b.get(66) && !b.get(500));
        assert_eq!(b.count_ones(), 8);
        let runs: Vec<_> = b.runs().collect();
        assert_eq!(runs, vec![(0, 3), (63, 3), (130, 1), (199, 1)]);
        b.clear(1);
        assert_eq!(b.runs().next(), Some((0, 1)));
        assert_eq!(b.next_clear(63), Some(66));
    }

    #[test]
    fn from_words_checks_length_and_masks_tail() {
        assert!(PageBitmap::from_words(vec![0], 65).is_none());
        let b = PageBitmap::from_words(vec![!0, !0, 7], 70).unwrap();
        assert_eq!(b.words().len(), 2);
        assert_eq!(b.count_ones(), 70);
        let all: Vec<_> = b.runs().collect();
        assert_eq!(all, vec![(0, 70)]);
    }

    #[test]
    fn full_bitmap_run_ends_at_len() {
        let mut b = PageBitmap::new(128);
        b.set_range(0, 128);
        assert_eq!(b.runs().collect::<Vec<_>>(), vec![(0, 128)]);
        assert_eq!(b.next_clear(0), None);
    }
}
