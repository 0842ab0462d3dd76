//! Template builds from Dockerfiles.
//!
//! A Dockerfile is parsed and evaluated on its base image's defaults ([`dockerfile`]);
//! its steps that change the disk (RUN, COPY) run inside a Clade VM booted from the
//! image built so far, with Clade's kernel and agent — no container daemon — and each
//! step's result is a frozen disk layer, cached by content ([`layers`]): the key of a
//! step is the hash of the key before it, the step as evaluated (command, environment,
//! working directory, user) and, for a COPY, every byte, name and mode it copies, so an
//! unchanged prefix of a Dockerfile is never run again.
//!
//! What the result is used for (a template's base layer and defaults) is the caller's:
//! this crate knows VMs, disks and images, not sandboxes.

pub mod dockerfile;
mod error;
pub mod layers;
pub mod vm;

pub use error::{Error, Result};

#[cfg(test)]
mod tests;
