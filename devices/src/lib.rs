//! Clade devices.
