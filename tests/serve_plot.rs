//! `serve`'s plot (`examples/common/serve_plot.rs`), tested here so that the README's
//! `cargo test` runs its tests: the axes' labels, the rolling window in the legend, a
//! marker per step that preempted.

#[path = "../examples/common/serve_plot.rs"]
mod serve_plot;
