//! Clade snapshot state formats (grows with the snapshot issue).
