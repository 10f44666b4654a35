//! `serve`'s plot: the runtime's per-step history ([`StepSample`]s, from
//! `KvCacheHandle::history`) drawn as an SVG with `plotters`. A pure function of the
//! samples, so that its unit tests below check what it draws (they run under `cargo
//! test`: the `serve` example is a test target, `test = true` in `Cargo.toml`).

use dsa_kv::actors::{StepSample, ROLLING_WINDOW};
use plotters::prelude::*;

/// Width and height of the plot, pixels.
const SIZE: (u32, u32) = (1000, 460);
/// GPU utilization.
const GPU: RGBColor = RGBColor(0xd6, 0x27, 0x28);
/// Host utilization.
const HOST: RGBColor = RGBColor(0xff, 0x7f, 0x0e);
/// Rolling prefix hit rate.
const HIT: RGBColor = RGBColor(0x1f, 0x77, 0xb4);
/// Steps with a preemption: one vertical line each.
pub(crate) const PREEMPTION: RGBColor = RGBColor(0x94, 0x67, 0xbd);

/// What one line plots of a step.
type Value = fn(&StepSample) -> f64;

/// The top of the y axis: the values end at 1.0, the legend sits above them.
const Y_TOP: f64 = 1.5;

/// The y axis label (every series is a fraction).
pub(crate) const Y_LABEL: &str = "fraction (0-1): pool slots in use / prompt tokens reused";
/// The x axis label.
pub(crate) const X_LABEL: &str = "step (runtime step number)";

/// The legend entry of the rolling hit rate: states its window.
pub(crate) fn hit_rate_label() -> String {
    format!("prefix hit rate, rolling over the last {ROLLING_WINDOW} steps")
}

/// GPU and host utilization of pool group 0 and the rolling prefix hit rate over the
/// steps of `history` (oldest first), with a vertical line at every step that preempted
/// a request; `dropped` samples before them are no longer kept (said in the title).
pub(crate) fn plot(history: &[StepSample], dropped: u64) -> Result<String, String> {
    let mut svg = String::new();
    draw(history, dropped, &mut svg).map_err(|e| format!("cannot draw the plot: {e}"))?;
    Ok(svg)
}

fn draw(
    history: &[StepSample],
    dropped: u64,
    svg: &mut String,
) -> Result<(), DrawingAreaErrorKind<std::io::Error>> {
    let first = history.first().map_or(0, |s| s.step);
    // A range of at least one step: plotters needs a non-empty axis.
    let last = history.last().map_or(1, |s| s.step).max(first + 1);
    let preemptions: u64 = history.iter().map(|s| u64::from(s.preempted)).sum();
    let mut title = format!(
        "dsa-kv serve: KV cache utilization and prefix hit rate, steps {first}-{last} \
         ({preemptions} preemptions)"
    );
    if dropped > 0 {
        title += &format!(", {dropped} earlier steps not kept");
    }
    let root = SVGBackend::with_string(svg, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(56)
        // Room above 1.0 for the legend, clear of the data.
        .build_cartesian_2d(first..last, 0f64..Y_TOP)?;
    chart
        .configure_mesh()
        .x_desc(X_LABEL)
        .y_desc(Y_LABEL)
        .y_label_formatter(&|v| {
            if *v <= 1.0 + 1e-9 {
                format!("{v:.1}")
            } else {
                String::new()
            }
        })
        .axis_desc_style(("sans-serif", 17))
        .label_style(("sans-serif", 15))
        .light_line_style(WHITE.mix(0.0))
        .draw()?;
    // The markers first, so that the lines stay readable on top of them.
    chart
        .draw_series(
            history
                .iter()
                .filter(|s| s.preempted > 0)
                .map(|s| PathElement::new(vec![(s.step, 0.0), (s.step, 1.0)], PREEMPTION)),
        )?
        .label("step with a preemption")
        .legend(|(x, y)| PathElement::new(vec![(x + 9, y - 6), (x + 9, y + 6)], PREEMPTION));
    let series: [(String, RGBColor, Value); 3] = [
        ("GPU utilization (pool group 0)".into(), GPU, |s| {
            s.gpu_utilization
        }),
        ("host utilization (pool group 0)".into(), HOST, |s| {
            s.host_utilization
        }),
        (hit_rate_label(), HIT, |s| s.rolling_hit_rate),
    ];
    for (label, color, value) in series {
        chart
            .draw_series(LineSeries::new(
                history.iter().map(|s| (s.step, value(s))),
                color.stroke_width(2),
            ))?
            .label(label)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 16))
        .draw()?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(step: u64, preempted: u32) -> StepSample {
        StepSample {
            step,
            gpu_utilization: 0.1 * step as f64,
            host_utilization: 0.0,
            rolling_hit_rate: 0.5,
            scheduled: 2,
            preempted,
            waiting: 0,
            manager_us: 10,
        }
    }

    /// `stroke="#9467BD"` elements: the preemption markers and their legend entry.
    fn markers(svg: &str) -> usize {
        let c = PREEMPTION;
        svg.matches(&format!("stroke=\"#{:02X}{:02X}{:02X}\"", c.0, c.1, c.2))
            .count()
    }

    #[test]
    fn the_plot_has_axes_a_legend_and_a_marker_per_preempting_step() {
        let calm: Vec<StepSample> = (1..=8).map(|s| sample(s, 0)).collect();
        let mut busy = calm.clone();
        busy[4].preempted = 2;
        busy[6].preempted = 1;
        let (calm, busy) = (plot(&calm, 0).unwrap(), plot(&busy, 0).unwrap());
        for svg in [&calm, &busy] {
            assert!(svg.starts_with("<svg"), "{svg}");
            assert!(svg.contains(X_LABEL), "x label: {svg}");
            assert!(svg.contains(Y_LABEL), "y label: {svg}");
            assert!(
                svg.contains("rolling over the last 256 steps"),
                "window: {svg}"
            );
            assert!(
                svg.contains("GPU utilization (pool group 0)"),
                "legend: {svg}"
            );
            assert!(svg.contains("step with a preemption"), "legend: {svg}");
        }
        assert!(busy.contains("steps 1-8 (3 preemptions)"), "title: {busy}");
        // One line per step that preempted, beside the legend's.
        assert_eq!((markers(&calm), markers(&busy)), (1, 3));
    }

    #[test]
    fn an_empty_or_truncated_history_still_plots() {
        let empty = plot(&[], 0).unwrap();
        assert!(empty.contains(X_LABEL), "{empty}");
        let late = plot(&[sample(500, 0)], 499).unwrap();
        assert!(late.contains("499 earlier steps not kept"), "{late}");
    }
}
