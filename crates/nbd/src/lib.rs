//! lull-nbd
