//! Frozen memory images ([`FrozenImage`]): read-only layers of files that forks and
//! copy-on-write snapshots map private, and freezing a [`GuestRam`] into one
//! ([`GuestRam::image_now`], [`GuestRam::restored_layers`], [`GuestRam::map_frozen`]).
//! Apart from `mod.rs`, which makes and maps guest memory, because freezing is its own
//! protocol: what it copies, what it maps, what it moves aside.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use snapshot::memory_file::MemoryChain;

use super::mapping::{mmap, retire};
use super::{memfd, Backing, GuestRam, HostRange, PAGE, PROT_RW};
use crate::error::{Error, Result};

/// One layer of a [`FrozenImage`]: a file nobody writes any more (a memfd, or a snapshot's
/// memory file), and the runs of the memory image it provides (image offset `o` is at file
/// offset `file_offset + o`).
#[derive(Debug)]
pub struct FrozenLayer {
    file: Arc<File>,
    /// Where the memory image starts in the file (page-aligned).
    file_offset: u64,
    /// `(image offset, length)`, page-aligned, sorted, not overlapping.
    runs: Vec<(u64, u64)>,
}

impl FrozenLayer {
    /// The layers of a snapshot's memory: the full file's whole image, then each diff's
    /// pages.
    fn of_snapshot(chain: &MemoryChain) -> Result<Vec<FrozenLayer>> {
        let mem = chain.mem_size();
        let mut layers = Vec::with_capacity(chain.layers().len());
        for f in chain.layers() {
            let runs = match f.present_pages() {
                None => vec![(0, mem)],
                Some(bm) => bm.runs().map(|(p, n)| (p * PAGE, n * PAGE)).collect(),
            };
            if runs.is_empty() {
                continue;
            }
            let file = f
                .file()
                .try_clone()
                .map_err(|e| Error::Memory(format!("duplicating a snapshot memory fd: {e}")))?;
            layers.push(FrozenLayer {
                file: Arc::new(file),
                file_offset: f.header().data_offset,
                runs,
            });
        }
        Ok(layers)
    }
}

/// A read-only view of a VM's memory image at the moment it was frozen (a fork, a
/// copy-on-write snapshot): layer 0 covers the whole image (a memfd, or the full memory
/// file of the snapshot the VM was restored from), each later layer the pages written
/// between two freezes (or a diff's pages). Every VM that runs on it maps the layers
/// `MAP_PRIVATE` in order, so pages stay shared (page cache of the files) until one of
/// them writes a page. Nothing writes the files: a snapshot's must stay as they are while
/// a VM maps them (as for the `file` backend).
#[derive(Debug)]
pub struct FrozenImage {
    layers: Vec<FrozenLayer>,
    pub(super) mem_bytes: u64,
}

/// One layer of a [`FrozenImage`] as handed between processes: its file, where the image
/// starts in it, and its runs `(image offset, length)`.
pub type LayerParts = (File, u64, Vec<(u64, u64)>);

/// The layers [`GuestRam::restored_layers`] prepared ([`RestoredLayers::into_image`]).
#[derive(Debug)]
pub struct RestoredLayers(Vec<FrozenLayer>);

impl RestoredLayers {
    /// The frozen image of `mem_bytes` of guest memory these layers make.
    pub fn into_image(self, mem_bytes: u64) -> Arc<FrozenImage> {
        Arc::new(FrozenImage {
            layers: self.0,
            mem_bytes,
        })
    }
}

/// Most layers (fork generations with writes in between) a frozen image may have; each
/// adds mappings (one per run of written pages) to every VM that maps it.
pub const MAX_FROZEN_LAYERS: usize = 64;

impl FrozenImage {
    /// Layers, base first.
    pub fn layers(&self) -> usize {
        self.layers.len()
    }

    /// Mappings a VM on this image has (one per run per layer).
    pub fn mappings(&self) -> usize {
        self.layers.iter().map(|l| l.runs.len()).sum()
    }

    /// The layers' files, where the image starts in each, and their runs, base first
    /// (handing the image to another process, writing it to a snapshot).
    pub fn parts(&self) -> impl Iterator<Item = (&File, u64, &[(u64, u64)])> {
        self.layers
            .iter()
            .map(|l| (&*l.file, l.file_offset, &l.runs[..]))
    }

    /// An image from its parts (received from another process).
    pub fn from_parts(parts: Vec<LayerParts>, mem_bytes: u64) -> Result<Self> {
        let layers = parts
            .into_iter()
            .map(|(f, file_offset, runs)| FrozenLayer {
                file: Arc::new(f),
                file_offset,
                runs,
            })
            .collect::<Vec<_>>();
        if layers.len() > MAX_FROZEN_LAYERS {
            return Err(Error::Memory(format!(
                "a frozen image of {} layers (at most {MAX_FROZEN_LAYERS})",
                layers.len()
            )));
        }
        for l in &layers {
            if l.file_offset % PAGE != 0 {
                return Err(Error::Memory(format!(
                    "frozen image layer at file offset {:#x}: not page-aligned",
                    l.file_offset
                )));
            }
            for &(o, n) in &l.runs {
                if o % PAGE != 0 || n % PAGE != 0 || o.checked_add(n).is_none_or(|e| e > mem_bytes)
                {
                    return Err(Error::Memory(format!(
                        "frozen image run {o:#x}+{n:#x} outside a {mem_bytes}-byte image"
                    )));
                }
            }
        }
        if layers.first().map(|l| &l.runs[..]) != Some(&[(0, mem_bytes)][..]) {
            return Err(Error::Memory(
                "frozen image: the first layer must cover all of memory".into(),
            ));
        }
        Ok(FrozenImage { layers, mem_bytes })
    }

    /// A one-layer image with a private copy of all of this image's memory (a fork by full
    /// copy: the baseline a copy-on-write fork is measured against).
    pub fn deep_copy(&self) -> Result<FrozenImage> {
        use std::os::unix::fs::FileExt;
        let copy = memfd("clade-frozen-copy", self.mem_bytes)?;
        let mut buf = vec![0u8; 1 << 20];
        for l in &self.layers {
            for &(off, len) in &l.runs {
                let mut done = 0;
                while done < len {
                    let n = (len - done).min(buf.len() as u64) as usize;
                    l.file
                        .read_exact_at(&mut buf[..n], l.file_offset + off + done)
                        .and_then(|()| copy.write_all_at(&buf[..n], off + done))
                        .map_err(|e| Error::Memory(format!("copying a frozen image: {e}")))?;
                    done += n as u64;
                }
            }
        }
        FrozenImage::from_parts(vec![(copy, 0, vec![(0, self.mem_bytes)])], self.mem_bytes)
    }

    /// Maps every layer, private, over `base..base + mem_bytes`.
    ///
    /// # Safety
    /// The range must be address space this process owns and holds no references into.
    pub(super) unsafe fn map_at(&self, base: usize) -> Result<()> {
        for l in &self.layers {
            // SAFETY: the caller's promise; the runs lie inside the range (checked when
            // the image was built).
            unsafe { map_runs(base, l) }?;
        }
        Ok(())
    }
}

/// Maps `runs` of `file` private and fixed at `base + offset`.
///
/// # Safety
/// As for [`FrozenImage::map_at`].
unsafe fn map_runs(base: usize, layer: &FrozenLayer) -> Result<()> {
    let flags = libc::MAP_PRIVATE | libc::MAP_NORESERVE | libc::MAP_FIXED;
    for &(off, len) in &layer.runs {
        // SAFETY: the caller's promise.
        unsafe {
            mmap(
                base + off as usize,
                len as usize,
                PROT_RW,
                flags,
                layer.file.as_raw_fd(),
                layer.file_offset + off,
                "mapping a frozen fork image",
            )
        }?;
    }
    Ok(())
}

/// Runs of set bits in per-range dirty bitmaps, as `(image offset, length)`.
pub fn dirty_runs(ranges: &[HostRange], dirty: &[Vec<u64>]) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for (r, bits) in ranges.iter().zip(dirty) {
        let pages = r.len as u64 / PAGE;
        for (wi, &w) in bits.iter().enumerate() {
            let mut w = w;
            while w != 0 {
                let p = wi as u64 * 64 + u64::from(w.trailing_zeros());
                w &= w - 1;
                if p >= pages {
                    break;
                }
                let off = r.image_offset + p * PAGE;
                match runs.last_mut() {
                    Some((o, n)) if *o + *n == off => *n += PAGE,
                    _ => runs.push((off, PAGE)),
                }
            }
        }
    }
    runs
}

impl GuestRam {
    /// Freezing, first half: the frozen image of this memory as it is now, made without
    /// touching its mapping, and whether it differs from the image the memory runs on
    /// (false: nothing was written since the last freeze, the memory already is that
    /// image). Call with the vCPUs and devices paused. [`GuestRam::map_frozen`] then maps
    /// it in place, or the VM moves onto a new mapping of it (`Vm::move_onto`).
    ///
    /// - memfd memory (booted VM): the memfd becomes the frozen base. No page is copied.
    /// - memory forked before: the pages written since (`dirty`, KVM's log and the VMM's
    ///   writes, one bitmap per range) are copied into a new memfd, a new layer on top of
    ///   the previous frozen image. Costs in proportion to the pages written, not to memory.
    ///
    /// Memory restored from a snapshot (the `uffd` and `file` backends) freezes with
    /// [`GuestRam::restored_layers`] instead.
    pub fn image_now(&self, dirty: Option<&[Vec<u64>]>) -> Result<(Arc<FrozenImage>, bool)> {
        match &self.backing {
            Backing::Memfd(file) => {
                let file =
                    Arc::new(file.try_clone().map_err(|e| {
                        Error::Memory(format!("duplicating the guest memory fd: {e}"))
                    })?);
                let layers = vec![FrozenLayer {
                    file,
                    file_offset: 0,
                    runs: vec![(0, self.len as u64)],
                }];
                Ok((
                    Arc::new(FrozenImage {
                        layers,
                        mem_bytes: self.len as u64,
                    }),
                    true,
                ))
            }
            Backing::Forked(prev) => {
                let dirty = dirty.ok_or_else(|| {
                    Error::Memory(
                        "forking again needs the pages written since the last fork (dirty \
                         page tracking is off)"
                            .into(),
                    )
                })?;
                let runs = dirty_runs(&self.ranges, dirty);
                if runs.is_empty() {
                    return Ok((Arc::clone(prev), false));
                }
                if prev.layers.len() >= MAX_FROZEN_LAYERS {
                    return Err(Error::Memory(format!(
                        "this VM's memory has {} fork layers (at most {MAX_FROZEN_LAYERS}): \
                         snapshot it and restore with the copy backend to start a new line",
                        prev.layers.len()
                    )));
                }
                let mut layers: Vec<FrozenLayer> = prev
                    .layers
                    .iter()
                    .map(|l| FrozenLayer {
                        file: Arc::clone(&l.file),
                        file_offset: l.file_offset,
                        runs: l.runs.clone(),
                    })
                    .collect();
                layers.push(self.copy_to_layer(runs)?);
                Ok((
                    Arc::new(FrozenImage {
                        layers,
                        mem_bytes: self.len as u64,
                    }),
                    true,
                ))
            }
            Backing::Anonymous | Backing::FilePrivate => Err(Error::Memory(
                "memory restored from a snapshot freezes with the snapshot it came from".into(),
            )),
        }
    }

    /// The first half of freezing memory restored from a snapshot (the `uffd` and `file`
    /// backends), written only where `dirty` says since it matched the snapshot whose
    /// memory files are `chain`: the layers of its frozen image — those files (the full
    /// one, each diff's pages over it) and the written pages copied into a layer on top.
    /// Changes nothing: [`GuestRam::map_frozen`] then maps them. Call with the vCPUs and
    /// devices paused (a page server may still run: the written pages are present).
    pub fn restored_layers(
        &self,
        chain: &MemoryChain,
        dirty: &[Vec<u64>],
    ) -> Result<RestoredLayers> {
        if !matches!(self.backing, Backing::Anonymous | Backing::FilePrivate) {
            return Err(Error::Memory(
                "only memory restored from a snapshot freezes with the snapshot".into(),
            ));
        }
        if chain.mem_size() != self.len as u64 {
            return Err(Error::Memory(format!(
                "a snapshot of {} bytes for {} bytes of guest memory",
                chain.mem_size(),
                self.len
            )));
        }
        let mut layers = FrozenLayer::of_snapshot(chain)?;
        let runs = dirty_runs(&self.ranges, dirty);
        if !runs.is_empty() {
            layers.push(self.copy_to_layer(runs)?);
        }
        if layers.len() > MAX_FROZEN_LAYERS {
            return Err(Error::Memory(format!(
                "a snapshot chain of {} memory files with the pages written since makes \
                 {} layers (at most {MAX_FROZEN_LAYERS})",
                chain.layers().len(),
                layers.len()
            )));
        }
        Ok(RestoredLayers(layers))
    }

    /// Freezing in place, second half: makes `image` (from [`GuestRam::image_now`] or
    /// [`RestoredLayers::into_image`]) this memory, at the same addresses; the VM runs on
    /// it from now on, copy-on-write. Forked memory maps the image's top layer (the pages
    /// written since) over itself (its private copies are freed and shared from then on).
    /// Any other is mapped over whole, private (KVM's memory slots keep pointing at it;
    /// its MMU notifiers drop KVM's mappings of every touched page, the part of the cost
    /// that grows with what the guest touched); its old mapping is not torn down here: its
    /// page tables are moved aside ([`Retired`], unmapped later off the pause). Call paused; for
    /// memory restored from a snapshot, with the page server stopped (the pages it never
    /// installed were never written: they come from the files). On an error the memory is
    /// as before (without the pages a stopped page server never installed).
    ///
    /// [`Retired`]: super::Retired
    pub fn map_frozen(&mut self, image: Arc<FrozenImage>) -> Result<Arc<FrozenImage>> {
        if let Backing::Forked(_) = self.backing {
            if let Some(layer) = image.layers.last() {
                // SAFETY: our own live mapping, which nothing writes while paused: the
                // written runs are replaced by mappings of their copies (same contents).
                unsafe { map_runs(self.base, layer) }?;
            }
            self.backing = Backing::Forked(Arc::clone(&image));
            return Ok(image);
        }
        self.remap_frozen(image)
    }

    /// A new memfd layer holding `runs` of this memory as they are now.
    fn copy_to_layer(&self, runs: Vec<(u64, u64)>) -> Result<FrozenLayer> {
        let layer = memfd("clade-fork-layer", self.len as u64)?;
        for &(off, len) in &runs {
            // SAFETY: inside our live mapping; nothing writes it while paused.
            let data = unsafe {
                std::slice::from_raw_parts((self.base + off as usize) as *const u8, len as usize)
            };
            layer.write_all_at(data, off).map_err(|e| {
                Error::Memory(format!("copying written pages to a fork layer: {e}"))
            })?;
        }
        Ok(FrozenLayer {
            file: Arc::new(layer),
            file_offset: 0,
            runs,
        })
    }

    /// Makes `layers` the whole of this memory: the current mapping is moved aside (see
    /// [`Retired`]) and the layers are mapped private over the same addresses.
    ///
    /// [`Retired`]: super::Retired
    fn remap_frozen(&mut self, image: Arc<FrozenImage>) -> Result<Arc<FrozenImage>> {
        // SAFETY: our own live mapping, which nothing accesses while paused; it is
        // mapped over right below.
        let retired = unsafe { retire(self.base, self.len) };
        // SAFETY: our own live mapping, replaced by a mapping of the same contents
        // (nothing writes guest memory while paused); references into it stay valid.
        // On an error (a partial mapping) the old contents are gone from the range: the
        // retired mapping is put back whole when there is one.
        if let Err(e) = unsafe { image.map_at(self.base) } {
            if let Some(r) = retired {
                // SAFETY: the retired mapping is ours and moves back over our own range.
                unsafe { r.restore_to(self.base) };
            }
            return Err(e);
        }
        self.backing = Backing::Forked(Arc::clone(&image));
        self.retired = retired;
        Ok(image)
    }
}
