//! lull-bench
