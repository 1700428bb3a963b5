//! Redis / Redis Cluster bucket store (being written).
