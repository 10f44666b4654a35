//! The NIXL transport (placeholder until the implementation lands).
