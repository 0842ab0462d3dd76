//! Clade VMM library.
