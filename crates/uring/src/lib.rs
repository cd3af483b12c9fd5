//! lull-uring
