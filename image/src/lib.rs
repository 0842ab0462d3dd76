//! Container images as Clade reads them: the root filesystem a template is made from, and
//! the defaults (environment, working directory, user, start command) its image config
//! gives.
//!
//! An image comes as an OCI image layout directory, an OCI archive (a tar of such a
//! layout) or a `docker save` archive ([`Source::open`]). Its layers are applied in order
//! into a directory ([`unpack`]), the way a container runtime's snapshotter would, but
//! with the tree treated as hostile input: every path is resolved inside the tree without
//! following symbolic links (a layer cannot write through `../` or through a symlink an
//! earlier layer planted), whiteouts and opaque directories remove what lower layers
//! made, hard links must point inside the tree, and each blob's SHA-256 must match its
//! digest (a corrupt or truncated archive is an error, never a half-applied layer passed
//! off as whole). The tree is a host directory, so it holds no device node, set-id bit,
//! xattr or owner of the image's: those are recorded ([`Fixup`]) and written into the
//! filesystem image made of it ([`build_disk`]), never onto the host.
//!
//! Reading manifests uses the `oci-spec` types and tar streams the `tar` crate; applying
//! entries is ours, because no crate applies OCI whiteouts with these guarantees.

mod config;
mod error;
mod pull;
mod rootfs;
mod source;
mod tarlimit;
mod unpack;

pub use config::ImageDefaults;
pub use error::{Error, Result};
pub use pull::{is_reference, pull, PullProgress, PullReport, MAX_BLOB, MAX_MANIFEST};
pub use rootfs::{build_disk, ConvertProgress, ConvertStep, RootfsDisk};
pub use source::{Layer, Source};
pub use tarlimit::{TarLimit, MAX_METADATA};
pub use unpack::{unpack, Fixup, Node, UnpackLimits, UnpackReport};

#[cfg(test)]
mod bounds_tests;
#[cfg(any(test, feature = "test-util"))]
pub mod testing;
#[cfg(test)]
mod tests;
