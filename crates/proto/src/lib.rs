//! lull-proto
