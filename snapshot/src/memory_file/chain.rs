//! [`MemoryChain`]: a full memory file and the diffs on top of it, verified to be one
//! chain, and reading guest pages from whichever layer owns each ([`PageLocation`]).
//! What the restore backends and the page server read memory through.

use std::path::Path;

use super::{HoleFill, MemoryFile, RegionInfo, MAX_CHAIN_LEN};
use crate::fetch::coalesce;
use crate::{state_file, Error, Result, PAGE_SIZE, PAGE_SIZE_U64};

/// Where a page of a [`MemoryChain`] comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageLocation {
    /// A zero page (a hole in the file that owns it).
    Zero,
    /// `PAGE_SIZE` bytes at `offset` of layer `layer`'s file.
    File {
        /// Index into [`MemoryChain::layers`].
        layer: usize,
        /// Byte offset in that file.
        offset: u64,
    },
}

/// A full memory file and the diffs on top of it, verified to form one chain with one
/// geometry. Restoring reads the base, then each diff over it.
#[derive(Debug)]
pub struct MemoryChain {
    layers: Vec<MemoryFile>,
    /// For chains longer than one: the layer that owns each page.
    owner: Option<Vec<u8>>,
}

impl MemoryChain {
    /// Verify `layers` (base first): the first is full, each next one is a diff whose base
    /// is the one before it, and all have the same regions.
    pub fn new(layers: Vec<MemoryFile>) -> Result<MemoryChain> {
        let first = layers
            .first()
            .ok_or_else(|| Error::InvalidInput("empty memory file chain".into()))?;
        if let Some(base) = first.header.base {
            return Err(Error::MissingBase { base });
        }
        if layers.len() > MAX_CHAIN_LEN {
            return Err(Error::InvalidInput(format!(
                "diff chain of {} files, at most {MAX_CHAIN_LEN} supported",
                layers.len()
            )));
        }
        for pair in layers.windows(2) {
            let (prev, cur) = (&pair[0].header, &pair[1].header);
            match cur.base {
                None => {
                    return Err(Error::InvalidInput(format!(
                        "full memory file {} given on top of {}",
                        pair[1].path.display(),
                        pair[0].path.display()
                    )))
                }
                Some(b) if b != prev.id => {
                    return Err(Error::BaseMismatch {
                        diff: cur.id,
                        expected: b,
                        found: prev.id,
                    })
                }
                Some(_) => {}
            }
            if cur.regions != prev.regions {
                return Err(Error::GeometryMismatch(format!(
                    "{} has regions {:?}, its base {} has {:?}",
                    pair[1].path.display(),
                    cur.regions,
                    pair[0].path.display(),
                    prev.regions
                )));
            }
        }
        let owner = (layers.len() > 1).then(|| {
            let mut owner = vec![0u8; first.header.pages() as usize];
            for (i, l) in layers.iter().enumerate().skip(1) {
                if let Some(p) = &l.present {
                    for (s, n) in p.runs() {
                        owner[s as usize..(s + n) as usize].fill(i as u8);
                    }
                }
            }
            owner
        });
        Ok(MemoryChain { layers, owner })
    }

    /// Open the files at `paths` (base first) and verify them as a chain.
    pub fn open(paths: &[&Path]) -> Result<MemoryChain> {
        let layers = paths
            .iter()
            .map(|p| MemoryFile::open(p))
            .collect::<Result<Vec<_>>>()?;
        MemoryChain::new(layers)
    }

    /// The files, base first.
    pub fn layers(&self) -> &[MemoryFile] {
        &self.layers
    }

    /// The newest file (whose id is the snapshot's).
    pub fn top(&self) -> &MemoryFile {
        // `new` guarantees at least one layer.
        &self.layers[self.layers.len() - 1]
    }

    /// Guest memory size.
    pub fn mem_size(&self) -> u64 {
        self.layers[0].header.mem_size
    }

    /// Number of pages.
    pub fn pages(&self) -> u64 {
        self.layers[0].header.pages()
    }

    /// The regions (same in every layer).
    pub fn regions(&self) -> &[RegionInfo] {
        &self.layers[0].header.regions
    }

    /// Check the chain against the snapshot's state header (the top layer must be that
    /// snapshot's memory file).
    pub fn check_state(&self, state: &state_file::Header) -> Result<()> {
        self.top().check_state(state)
    }

    /// Which layer owns `page` and whether it is a zero page. Panics never: pages past
    /// the end are reported as [`PageLocation::Zero`].
    pub fn locate(&self, page: u64) -> PageLocation {
        if page >= self.pages() {
            return PageLocation::Zero;
        }
        let layer = self.owner.as_ref().map_or(0, |o| o[page as usize] as usize);
        let f = &self.layers[layer];
        if f.data.get(page) {
            PageLocation::File {
                layer,
                offset: f.header.data_offset + page * PAGE_SIZE_U64,
            }
        } else {
            PageLocation::Zero
        }
    }

    /// Read `buf.len() / PAGE_SIZE` pages starting at `first_page` from the layers that
    /// own them. `buf` must be a whole number of pages inside the image.
    pub fn read_pages(&self, first_page: u64, buf: &mut [u8]) -> Result<()> {
        let n = (buf.len() / PAGE_SIZE) as u64;
        if !buf.len().is_multiple_of(PAGE_SIZE)
            || first_page.checked_add(n).is_none_or(|e| e > self.pages())
        {
            return Err(Error::InvalidInput(format!(
                "read of {} bytes at page {first_page} outside the {}-page image",
                buf.len(),
                self.pages()
            )));
        }
        let owner_of = |p: u64| self.owner.as_ref().map_or(0, |o| o[p as usize]);
        let mut i = 0u64;
        while i < n {
            let layer = owner_of(first_page + i);
            let mut j = i + 1;
            while j < n && owner_of(first_page + j) == layer {
                j += 1;
            }
            let dst = &mut buf[(i * PAGE_SIZE_U64) as usize..(j * PAGE_SIZE_U64) as usize];
            self.layers[layer as usize].read_run(dst, first_page + i)?;
            i = j;
        }
        Ok(())
    }

    /// Tell the fetchers of lazily filled layers that `pages` will be read soon, so that
    /// they fetch them in parallel (see [`crate::fetch::ChunkFetch::prefetch`]); nothing
    /// for layers on local disk.
    pub fn prefetch_pages(&self, pages: &[u64]) {
        if self.layers.iter().all(|l| l.fetch.is_none()) {
            return;
        }
        let mut per_layer: Vec<Vec<(u64, u64)>> = vec![Vec::new(); self.layers.len()];
        for &p in pages {
            if let PageLocation::File { layer, offset } = self.locate(p) {
                per_layer[layer].push((offset, PAGE_SIZE_U64));
            }
        }
        for (l, mut ranges) in self.layers.iter().zip(per_layer) {
            if let (Some(f), false) = (&l.fetch, ranges.is_empty()) {
                coalesce(&mut ranges);
                f.0.prefetch(&ranges);
            }
        }
    }

    /// Tell the fetchers of lazily filled layers that every data page will be read (an
    /// eager restore, or filling what a guest never touched): they fetch in parallel.
    pub fn prefetch_all(&self) {
        for l in &self.layers {
            if let Some(f) = &l.fetch {
                let d = l.header.data_offset;
                let ranges: Vec<(u64, u64)> = l
                    .data
                    .runs()
                    .map(|(s, n)| (d + s * PAGE_SIZE_U64, n * PAGE_SIZE_U64))
                    .collect();
                f.0.prefetch(&ranges);
            }
        }
    }

    /// Eagerly restore the whole chain into `dst` (the `copy` backend): the base's data
    /// extents, then each diff's pages. Everything is verified before `dst` is touched.
    pub fn restore_into(&self, dst: &mut [u8], fill: HoleFill) -> Result<u64> {
        self.prefetch_all();
        let mut n = self.layers[0].read_into(dst, fill)?;
        n += self.overlay_diffs_into(dst)?;
        Ok(n)
    }

    /// Write only the diff layers over `dst`, which already holds the base image (the
    /// `file` backend maps the base file `MAP_PRIVATE` and then calls this).
    pub fn overlay_diffs_into(&self, dst: &mut [u8]) -> Result<u64> {
        let mut n = 0;
        for l in &self.layers[1..] {
            n += l.overlay_into(dst)?;
        }
        Ok(n)
    }
}
