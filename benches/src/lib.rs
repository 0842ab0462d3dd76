//! Benchmark statistics.
