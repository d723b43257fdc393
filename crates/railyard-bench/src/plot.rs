//! SVG charts of bench result rows: the arrays every scenario's `--json FILE`
//! writes, drawn by `railyard bench plot`.
//!
//! Each file gets a **headline chart**: one group of bars per configuration
//! (the fields that differ between the file's rows, e.g. the matrix's
//! consumer / delivery / method), one bar per system at the median of its
//! runs, every run drawn as a dot on its bar and the median written above it,
//! so the side-by-side ratio and the run-to-run spread are both visible.
//! Scenarios that measure latency (c10k, saga, redis-refresh) also get a
//! **latency chart**: the median of each percentile per system and
//! configuration, on a log scale.
//!
//! Drawn with `plotters`' SVG backend only (no system fonts or libraries):
//! the text stays text, so the charts diff and grep like the tables.

use std::collections::BTreeMap;

use plotters::coord::Shift;
use plotters::prelude::*;
use serde_json::Value;

use crate::report::median;

/// One rendered chart.
#[derive(Debug, Clone)]
pub struct Chart {
    /// A file-name suffix: `""` for the headline chart, `"-latency"` for the
    /// percentile chart.
    pub suffix: &'static str,
    /// The chart's title.
    pub title: String,
    /// The SVG document.
    pub svg: String,
}

/// Why rows could not be charted.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// Nothing to draw.
    #[error("no result rows to plot (expected a JSON array written by `railyard bench ... --json FILE`)")]
    NoRows,
    /// The rows' `scenario` is not one this module knows.
    #[error("cannot plot scenario {0:?}: known scenarios are {known}", known = known())]
    UnknownScenario(String),
    /// Rows of several scenarios in one file.
    #[error("the rows mix scenarios ({0}); plot one scenario's file at a time")]
    MixedScenarios(String),
    /// No row carries the scenario's headline figure.
    #[error("no row has {metric} (the {scenario} scenario's headline figure)")]
    NoMetric {
        /// The scenario.
        scenario: String,
        /// The missing field, as a JSON pointer.
        metric: &'static str,
    },
    /// The drawing library failed.
    #[error("drawing the chart: {0}")]
    Draw(String),
}

/// What to draw for one scenario.
struct Spec {
    scenario: &'static str,
    /// JSON pointer to the headline figure.
    metric: &'static str,
    /// Its axis label.
    metric_label: &'static str,
    lower_is_better: bool,
    /// Fields that together name a configuration.
    config: &'static [&'static str],
    /// JSON pointer to an object of latency percentiles in ms.
    latency: Option<&'static str>,
}

const SPECS: &[Spec] = &[
    Spec {
        scenario: "pingpong",
        metric: "/all_replies_ms",
        metric_label: "all replies received, ms (lower is better)",
        lower_is_better: true,
        config: &["cluster", "nodes", "messages"],
        latency: None,
    },
    Spec {
        scenario: "echo",
        metric: "/round_trips_per_s",
        metric_label: "round trips/s",
        lower_is_better: false,
        config: &[
            "cluster",
            "nodes",
            "consumer",
            "delivery",
            "method",
            "instances",
            "in_flight",
        ],
        latency: None,
    },
    Spec {
        scenario: "bridge",
        metric: "/round_trips_per_s",
        metric_label: "round trips/s",
        lower_is_better: false,
        config: &["clients", "in_flight", "body_bytes", "server_threads"],
        latency: None,
    },
    Spec {
        scenario: "c10k",
        metric: "/requests_per_s",
        metric_label: "requests/s",
        lower_is_better: false,
        config: &["path", "connections", "instances"],
        latency: Some("/latency_ms"),
    },
    Spec {
        scenario: "saga",
        metric: "/tx_per_s",
        metric_label: "transactions/s",
        lower_is_better: false,
        config: &["protocol", "store", "concurrency", "abort_ratio"],
        latency: Some("/latency_ms"),
    },
    Spec {
        scenario: "redis-refresh",
        metric: "/latency_ms/p99",
        metric_label: "p99 latency, ms (lower is better)",
        lower_is_better: true,
        config: &["nodes", "rate", "refresh", "churn"],
        latency: Some("/latency_ms"),
    },
];

/// The scenarios [`SPECS`] covers, for the error that names them.
fn known() -> String {
    SPECS
        .iter()
        .map(|s| s.scenario)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Percentiles drawn on the latency chart, in order, with their labels.
const PERCENTILES: [(&str, &str); 6] = [
    ("p50", "p50"),
    ("p90", "p90"),
    ("p95", "p95"),
    ("p99", "p99"),
    ("p999", "p99.9"),
    ("max", "max"),
];

/// Railyard first and always in the same colour; peers after it.
const COLOURS: [RGBColor; 6] = [
    RGBColor(0x1f, 0x6f, 0xb4),
    RGBColor(0xe0, 0x6c, 0x10),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xc0, 0x30, 0x30),
    RGBColor(0x80, 0x50, 0xb0),
    RGBColor(0x70, 0x70, 0x70),
];

/// The charts for one file's rows (all of one scenario).
///
/// # Errors
/// [`PlotError`] for empty input, mixed or unknown scenarios, rows without
/// the headline figure, or a drawing failure.
pub fn charts(rows: &[Value]) -> Result<Vec<Chart>, PlotError> {
    if rows.is_empty() {
        return Err(PlotError::NoRows);
    }
    let mut scenarios: Vec<&str> = rows
        .iter()
        .map(|r| {
            r.get("scenario")
                .and_then(Value::as_str)
                .unwrap_or("(none)")
        })
        .collect();
    scenarios.sort_unstable();
    scenarios.dedup();
    if scenarios.len() > 1 {
        return Err(PlotError::MixedScenarios(scenarios.join(", ")));
    }
    let scenario = scenarios[0];
    let spec = SPECS
        .iter()
        .find(|s| s.scenario == scenario)
        .ok_or_else(|| PlotError::UnknownScenario(scenario.to_owned()))?;
    let named = name_variants(rows, spec.config);
    let rows = named.as_slice();
    let grouping = grouping_fields(rows, spec.config);
    let labels = config_labels(rows, &grouping);
    let (notes, common) = system_notes(rows, spec.config, &grouping);
    let systems = systems(rows);
    let legend: Vec<String> = systems
        .iter()
        .map(|s| match notes.get(s) {
            Some(n) if !n.is_empty() => format!("{s} ({n})"),
            _ => s.clone(),
        })
        .collect();

    let mut out = Vec::new();
    let bars = group(rows, &labels, |r| {
        r.pointer(spec.metric).and_then(Value::as_f64)
    });
    if bars.is_empty() {
        return Err(PlotError::NoMetric {
            scenario: scenario.to_owned(),
            metric: spec.metric,
        });
    }
    let title = headline_title(spec, &bars, &systems);
    out.push(Chart {
        suffix: "",
        svg: bar_chart(&title, spec, &common, &bars, &systems, &legend)?,
        title,
    });

    if let Some(lat) = spec.latency {
        let mut lines: Vec<Line> = Vec::new();
        for (c, (config, mut by_system)) in
            group_latency(rows, &labels, lat).into_iter().enumerate()
        {
            for (colour, system) in systems.iter().enumerate() {
                let Some(points) = by_system.remove(system) else {
                    continue;
                };
                let name = legend
                    .get(colour)
                    .cloned()
                    .unwrap_or_else(|| system.clone());
                let name = if config.is_empty() {
                    name
                } else {
                    format!("{name} {config}")
                };
                // A system's configurations: the first thick, the others thin.
                let width = if c == 0 { 3 } else { 1 };
                lines.push(Line {
                    name,
                    colour,
                    width,
                    points,
                });
            }
        }
        lines.sort_by_key(|l| l.colour);
        if !lines.is_empty() {
            let title = format!("{scenario}: latency percentiles (median of runs)");
            out.push(Chart {
                suffix: "-latency",
                svg: latency_chart(&title, &lines)?,
                title,
            });
        }
    }
    Ok(out)
}

/// A field's value as label text; `None` when absent or null.
fn field_text(r: &Value, f: &str) -> Option<String> {
    r.get(f).filter(|v| !v.is_null()).map(|v| match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    })
}

fn system_of(r: &Value) -> &str {
    r.get("system").and_then(Value::as_str).unwrap_or("?")
}

/// A field only one system's rows carry, with more than one value among
/// them (Vert.x run with 2 and with 4 instances per core beside Railyard),
/// names variants of that system: the rows come back with `system` set to
/// `"vertx instances=2"` and so on, so each variant gets its own bar.
fn name_variants(rows: &[Value], config: &[&str]) -> Vec<Value> {
    let variant: Vec<&str> = config
        .iter()
        .copied()
        .filter(|f| {
            let carriers: Vec<&Value> =
                rows.iter().filter(|r| field_text(r, f).is_some()).collect();
            let Some(first) = carriers.first() else {
                return false;
            };
            let one_system = carriers.iter().all(|r| system_of(r) == system_of(first));
            let present_elsewhere = rows.iter().any(|r| system_of(r) != system_of(first));
            let mut values: Vec<String> =
                carriers.iter().filter_map(|r| field_text(r, f)).collect();
            values.sort();
            values.dedup();
            one_system && present_elsewhere && values.len() > 1
        })
        .collect();
    rows.iter()
        .map(|r| {
            let mut r = r.clone();
            let parts = pairs(&r, &variant);
            if !parts.is_empty() {
                let name = format!("{} {parts}", system_of(&r));
                if let Some(o) = r.as_object_mut() {
                    for f in &variant {
                        o.remove(*f);
                    }
                    o.insert("system".into(), Value::String(name));
                }
            }
            r
        })
        .collect()
}

/// The fields of `config` that take more than one value within one
/// system's rows: those name the configurations compared. A field that
/// differs only between systems (DTM's `store=boltdb` beside Railyard's
/// `embedded`) describes the system instead (see [`system_notes`]).
fn grouping_fields<'a>(rows: &[Value], config: &[&'a str]) -> Vec<&'a str> {
    config
        .iter()
        .copied()
        .filter(|f| {
            let mut seen: Vec<(&str, Option<String>)> = rows
                .iter()
                .map(|r| (system_of(r), field_text(r, f)))
                .collect();
            seen.sort();
            seen.dedup();
            seen.windows(2).any(|w| w[0].0 == w[1].0)
        })
        .collect()
}

/// One system and configuration on the latency chart.
struct Line {
    name: String,
    /// Index into [`COLOURS`]: the system's.
    colour: usize,
    width: u32,
    /// (index into [`PERCENTILES`], median ms).
    points: Vec<(usize, f64)>,
}

/// Each row's configuration label from the grouping fields (empty when
/// every system ran one configuration).
fn config_labels(rows: &[Value], fields: &[&str]) -> Vec<String> {
    rows.iter().map(|r| pairs(r, fields)).collect()
}

/// `"field=value ..."` for the fields `r` carries, with short names.
fn pairs(r: &Value, fields: &[&str]) -> String {
    let parts: Vec<String> = fields
        .iter()
        .filter_map(|f| field_text(r, f).map(|v| format!("{}={v}", short(f))))
        .collect();
    parts.join(" ")
}

/// What a system ran with, where it differs from another system's run:
/// `system -> "protocol=http store=boltdb"`; and what every row shares, for
/// the axis note.
fn system_notes(
    rows: &[Value],
    config: &[&str],
    grouping: &[&str],
) -> (BTreeMap<String, String>, String) {
    let mut notes: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut common = Vec::new();
    for f in config.iter().filter(|f| !grouping.contains(f)) {
        let mut values: Vec<Option<String>> = rows.iter().map(|r| field_text(r, f)).collect();
        values.sort();
        values.dedup();
        match values.as_slice() {
            [None] => {}
            [Some(v)] => common.push(format!("{}={v}", short(f))),
            _ => {
                for r in rows {
                    if let Some(v) = field_text(r, f) {
                        let note = notes.entry(system_of(r).to_owned()).or_default();
                        let part = format!("{}={v}", short(f));
                        if !note.contains(&part) {
                            note.push(part);
                        }
                    }
                }
            }
        }
    }
    (
        notes.into_iter().map(|(k, v)| (k, v.join(" "))).collect(),
        common.join(" "),
    )
}

/// Short names for the label fields that would otherwise crowd the axis.
fn short(field: &str) -> &str {
    match field {
        "in_flight" => "in-flight",
        "connections" => "conns",
        "concurrency" => "conc",
        "abort_ratio" => "aborts",
        "server_threads" => "threads",
        "body_bytes" => "body",
        other => other,
    }
}

/// Systems in first-seen order, with `railyard` first.
fn systems(rows: &[Value]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for r in rows {
        let s = system_of(r);
        if !out.iter().any(|o| o == s) {
            out.push(s.to_owned());
        }
    }
    out.sort_by_key(|s| !s.starts_with("railyard"));
    out
}

/// The entry for `label` in a list kept in first-seen order, added if new.
fn slot<'a, T: Default>(list: &'a mut Vec<(String, T)>, label: &str) -> &'a mut T {
    let i = match list.iter().position(|(l, _)| l == label) {
        Some(i) => i,
        None => {
            list.push((label.to_owned(), T::default()));
            list.len() - 1
        }
    };
    &mut list[i].1
}

/// Configuration label -> system -> every run's figure, in the order the
/// configurations first appear.
type Groups = Vec<(String, BTreeMap<String, Vec<f64>>)>;

fn group(rows: &[Value], labels: &[String], figure: impl Fn(&Value) -> Option<f64>) -> Groups {
    let mut out: Groups = Vec::new();
    for (i, r) in rows.iter().enumerate() {
        let Some(v) = figure(r).filter(|v| v.is_finite()) else {
            continue;
        };
        slot(&mut out, &labels[i])
            .entry(system_of(r).to_owned())
            .or_default()
            .push(v);
    }
    out
}

/// Configuration label -> system -> (index into [`PERCENTILES`], median ms).
type LatencyGroups = Vec<(String, BTreeMap<String, Vec<(usize, f64)>>)>;

/// The latency chart's points, per configuration and system.
fn group_latency(rows: &[Value], labels: &[String], pointer: &str) -> LatencyGroups {
    let per: Vec<Groups> = PERCENTILES
        .iter()
        .map(|(key, _)| {
            group(rows, labels, |r| {
                r.pointer(pointer)
                    .and_then(|o| o.get(*key))
                    .and_then(Value::as_f64)
            })
        })
        .collect();
    let mut out: LatencyGroups = Vec::new();
    for (p, groups) in per.iter().enumerate() {
        for (label, by_system) in groups {
            let by_label = slot(&mut out, label);
            for (system, runs) in by_system {
                if let Some(m) = median(runs).filter(|m| *m > 0.0) {
                    by_label.entry(system.clone()).or_default().push((p, m));
                }
            }
        }
    }
    out
}

/// The first system's median over the second's, as "how many times
/// better" (inverted when lower is better); `None` unless both ran.
fn ratio(spec: &Spec, by: &BTreeMap<String, Vec<f64>>, systems: &[String]) -> Option<f64> {
    let [a, b, ..] = systems else { return None };
    let ma = by.get(a).and_then(|v| median(v)).filter(|m| *m > 0.0)?;
    let mb = by.get(b).and_then(|v| median(v)).filter(|m| *m > 0.0)?;
    Some(if spec.lower_is_better {
        mb / ma
    } else {
        ma / mb
    })
}

/// "pingpong: railyard is 8.90x vertx (medians)" when exactly two systems
/// ran one configuration; the scenario's name otherwise.
fn headline_title(spec: &Spec, bars: &Groups, systems: &[String]) -> String {
    if let ([a, b], [(_, by)]) = (systems, bars.as_slice()) {
        if let Some(r) = ratio(spec, by, systems) {
            return format!("{}: {a} is {r:.2}x {b} (medians)", spec.scenario);
        }
    }
    format!("{}: median of runs, every run a dot", spec.scenario)
}

/// "railyard/vertx 4.07x" for a group both of the first two systems ran.
fn group_ratio(spec: &Spec, by: &BTreeMap<String, Vec<f64>>, systems: &[String]) -> Option<String> {
    let r = ratio(spec, by, systems)?;
    Some(format!("{}/{} {r:.2}x", systems[0], systems[1]))
}

/// 1234567 -> "1.23M", 45678 -> "45.7k", 12.345 -> "12.3".
fn si(v: f64) -> String {
    let a = v.abs();
    if a == 0.0 {
        "0".to_owned()
    } else if a >= 1e6 {
        format!("{:.2}M", v / 1e6)
    } else if a >= 1e4 {
        format!("{:.1}k", v / 1e3)
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn draw_err<E: std::fmt::Debug>(e: E) -> PlotError {
    PlotError::Draw(format!("{e:?}"))
}

fn bar_chart(
    title: &str,
    spec: &Spec,
    common: &str,
    bars: &Groups,
    systems: &[String],
    legend: &[String],
) -> Result<String, PlotError> {
    let groups = bars.len();
    let width = (220 * groups as u32).clamp(640, 2400);
    // Group labels go one field per line, then the ratio line.
    let label_lines = bars
        .iter()
        .map(|(l, _)| l.split(' ').count())
        .max()
        .unwrap_or(1)
        + 1;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (width, 480)).into_drawing_area();
        root.fill(&WHITE).map_err(draw_err)?;
        let top = bars
            .iter()
            .flat_map(|(_, by)| by.values().flatten().copied())
            .fold(0.0_f64, f64::max)
            .max(f64::MIN_POSITIVE);
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(16 * label_lines as u32 + 28)
            .y_label_area_size(72)
            .build_cartesian_2d(0.0..groups as f64, 0.0..top * 1.3)
            .map_err(draw_err)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .disable_x_axis()
            .y_desc(spec.metric_label)
            .y_label_formatter(&|v| si(*v))
            .draw()
            .map_err(draw_err)?;
        let n = systems.len().max(1) as f64;
        let slot = 0.8 / n;
        for (g, (label, by)) in bars.iter().enumerate() {
            let x0 = g as f64 + 0.1;
            for (k, system) in systems.iter().enumerate() {
                let Some(runs) = by.get(system) else { continue };
                let Some(m) = median(runs) else { continue };
                let colour = COLOURS[k % COLOURS.len()];
                let (l, r) = (x0 + slot * k as f64, x0 + slot * (k as f64 + 0.9));
                chart
                    .draw_series(std::iter::once(Rectangle::new(
                        [(l, 0.0), (r, m)],
                        colour.mix(0.75).filled(),
                    )))
                    .map_err(draw_err)?;
                let mid = (l + r) / 2.0;
                chart
                    .draw_series(
                        runs.iter()
                            .map(|v| Circle::new((mid, *v), 3, BLACK.filled())),
                    )
                    .map_err(draw_err)?;
                // Above the highest run, so no dot hides it.
                let top_run = runs.iter().copied().fold(m, f64::max);
                chart
                    .draw_series(std::iter::once(
                        EmptyElement::at((mid, top_run))
                            + Text::new(
                                si(m),
                                (-14, -16),
                                ("sans-serif", 12).into_font().color(&BLACK),
                            ),
                    ))
                    .map_err(draw_err)?;
            }
            let label = if label.is_empty() { common } else { label };
            let mut lines: Vec<String> = label.split(' ').map(str::to_owned).collect();
            if let Some(r) = group_ratio(spec, by, systems) {
                lines.push(r);
            }
            chart
                .draw_series(lines.into_iter().enumerate().map(|(i, line)| {
                    EmptyElement::at((g as f64 + 0.1, 0.0))
                        + Text::new(line, (0, 8 + 16 * i as i32), ("sans-serif", 13))
                }))
                .map_err(draw_err)?;
        }
        if bars.iter().any(|(l, _)| !l.is_empty()) && !common.is_empty() {
            chart
                .draw_series(std::iter::once(
                    EmptyElement::at((0.0, 0.0))
                        + Text::new(
                            format!("all runs: {common}"),
                            (0, 12 + 16 * label_lines as i32),
                            ("sans-serif", 12),
                        ),
                ))
                .map_err(draw_err)?;
        }
        // The legend: one swatch per system.
        for (k, name) in legend.iter().enumerate() {
            let colour = COLOURS[k % COLOURS.len()];
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [(0.0, 0.0), (0.0, 0.0)],
                    colour.filled(),
                )))
                .map_err(draw_err)?
                .label(name.as_str())
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 12, y + 5)], colour.filled())
                });
        }
        finish(&mut chart, &root, SeriesLabelPosition::UpperRight)?;
    }
    Ok(svg)
}

/// Draws the legend at `position` and writes the chart out.
fn finish<'a, CT: plotters::coord::CoordTranslate>(
    chart: &mut ChartContext<'a, SVGBackend<'a>, CT>,
    root: &DrawingArea<SVGBackend<'a>, Shift>,
    position: SeriesLabelPosition,
) -> Result<(), PlotError> {
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(draw_err)?;
    root.present().map_err(draw_err)
}

fn latency_chart(title: &str, lines: &[Line]) -> Result<String, PlotError> {
    let values = lines.iter().flat_map(|l| l.points.iter().map(|(_, v)| *v));
    let (lo, hi) = values.fold((f64::MAX, f64::MIN_POSITIVE), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    let (lo, hi) = (lo / 1.5, hi * 1.5);
    let mut svg = String::new();
    {
        let root: DrawingArea<SVGBackend<'_>, Shift> =
            SVGBackend::with_string(&mut svg, (800, 480)).into_drawing_area();
        root.fill(&WHITE).map_err(draw_err)?;
        let last = (PERCENTILES.len() - 1) as f64;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(72)
            .build_cartesian_2d(-0.3..last + 0.3, (lo..hi).log_scale())
            .map_err(draw_err)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .disable_x_axis()
            .y_desc("latency, ms (log scale)")
            .y_label_formatter(&|v| si(*v))
            .draw()
            .map_err(draw_err)?;
        for (i, (_, label)) in PERCENTILES.iter().enumerate() {
            chart
                .draw_series(std::iter::once(
                    EmptyElement::at((i as f64, lo))
                        + Text::new(label.to_string(), (-10, 8), ("sans-serif", 13)),
                ))
                .map_err(draw_err)?;
        }
        for line in lines {
            let colour = COLOURS[line.colour % COLOURS.len()];
            let pts: Vec<(f64, f64)> = line.points.iter().map(|(p, v)| (*p as f64, *v)).collect();
            let style = colour.stroke_width(line.width);
            chart
                .draw_series(LineSeries::new(pts.clone(), style))
                .map_err(draw_err)?
                .label(line.name.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], style));
            chart
                .draw_series(pts.iter().map(|p| Circle::new(*p, 3, colour.filled())))
                .map_err(draw_err)?;
        }
        finish(&mut chart, &root, SeriesLabelPosition::LowerRight)?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn echo_row(system: &str, method: &str, rt: f64) -> Value {
        json!({"scenario": "echo", "system": system, "cluster": "none", "nodes": 1,
               "consumer": "consumer", "delivery": "default", "method": method,
               "instances": 2, "in_flight": 64, "round_trips_per_s": rt})
    }

    #[test]
    fn echo_bars_name_every_configuration_system_and_median() {
        let rows = vec![
            echo_row("railyard", "send-reply", 3_000_000.0),
            echo_row("railyard", "send-reply", 4_000_000.0),
            echo_row("railyard", "send-reply", 3_200_000.0),
            echo_row("vertx", "send-reply", 1_000_000.0),
            echo_row("railyard", "send-send", 5_000_000.0),
            echo_row("vertx", "send-send", 6_000_000.0),
        ];
        let charts = charts(&rows).unwrap();
        assert_eq!(charts.len(), 1, "echo has no latency chart");
        let svg = &charts[0].svg;
        assert!(svg.starts_with("<svg"), "{}", &svg[..40.min(svg.len())]);
        // Only the varying field labels the groups.
        assert!(svg.contains("method=send-reply") && svg.contains("method=send-send"));
        assert!(!svg.contains("cluster=none method="));
        assert!(svg.contains("all runs: cluster=none nodes=1 consumer=consumer"));
        assert!(svg.contains("\nrailyard\n") && svg.contains("\nvertx\n"));
        // Medians above the bars: 3.2M for railyard send-reply, not the
        // mean (3.4M).
        assert!(svg.contains("3.20M"), "median label missing");
        assert!(!svg.contains("3.40M"));
        // Each group carries its ratio of medians: 3.2M / 1M.
        assert!(svg.contains("railyard/vertx 3.20x"));
        assert!(svg.contains("railyard/vertx 0.83x"));
        // One dot per run: six rows, six run dots (black circles of radius 3).
        assert_eq!(svg.matches("r=\"3\"").count(), 6);
    }

    #[test]
    fn two_systems_one_configuration_put_the_ratio_in_the_title() {
        let rows = vec![
            json!({"scenario": "pingpong", "system": "railyard", "cluster": "none",
                   "nodes": 1, "messages": 500000, "all_replies_ms": 150.0}),
            json!({"scenario": "pingpong", "system": "vertx", "cluster": "none",
                   "nodes": 1, "messages": 500000, "all_replies_ms": 1500.0}),
        ];
        let c = charts(&rows).unwrap();
        // Lower is better for pingpong: 1500 / 150.
        assert_eq!(c[0].title, "pingpong: railyard is 10.00x vertx (medians)");
    }

    #[test]
    fn latency_scenarios_get_a_percentile_chart() {
        let row = |system: &str, p99: f64| {
            json!({"scenario": "saga", "system": system, "protocol": "omega",
                   "store": "embedded", "concurrency": 500, "abort_ratio": 0.0,
                   "tx_per_s": 6000.0,
                   "latency_ms": {"p50": 50.0, "p99": p99, "p999": 150.0, "max": 200.0}})
        };
        let c = charts(&[row("railyard", 100.0), row("dtm", 900.0)]).unwrap();
        assert_eq!(c.len(), 2);
        assert_eq!(c[1].suffix, "-latency");
        let svg = &c[1].svg;
        assert!(svg.contains("\np99.9\n") && svg.contains("\np50\n"));
        // One line per system in its colour (railyard's, then the peer's),
        // plus its legend swatch.
        let lines = |colour: &str| {
            svg.lines()
                .filter(|l| l.starts_with("<polyline") && l.contains(colour))
                .count()
        };
        assert_eq!(lines("stroke=\"#1F6FB4\""), 2, "{svg}");
        assert_eq!(lines("stroke=\"#E06C10\""), 2);
    }

    #[test]
    fn a_field_only_one_system_varies_names_its_variants() {
        let row = |system: &str, instances: Option<u32>, rps: f64| {
            let mut r = json!({"scenario": "c10k", "system": system, "path": "/static/4k",
                               "connections": 10000, "requests_per_s": rps});
            if let Some(i) = instances {
                r["instances"] = json!(i);
            }
            r
        };
        let rows = [
            row("railyard", None, 65_000.0),
            row("vertx", Some(2), 53_000.0),
            row("vertx", Some(4), 52_000.0),
        ];
        let c = charts(&rows).unwrap();
        let svg = &c[0].svg;
        // One group (path and connections are common), three bars.
        assert!(svg.contains("\nvertx instances=2\n") && svg.contains("\nvertx instances=4\n"));
        assert!(svg.contains("railyard/vertx instances=2 1.23x"), "{svg}");
        assert!(
            !svg.contains("\ninstances=2\n"),
            "not a configuration group"
        );
    }

    #[test]
    fn bad_input_is_a_typed_error() {
        assert!(matches!(charts(&[]), Err(PlotError::NoRows)));
        let unknown = [json!({"scenario": "nope", "system": "railyard"})];
        assert!(matches!(charts(&unknown), Err(PlotError::UnknownScenario(s)) if s == "nope"));
        let mixed = [
            echo_row("railyard", "send-send", 1.0),
            json!({"scenario": "pingpong", "system": "railyard", "all_replies_ms": 1.0}),
        ];
        assert!(matches!(charts(&mixed), Err(PlotError::MixedScenarios(_))));
        let no_metric = [json!({"scenario": "echo", "system": "railyard"})];
        assert!(matches!(
            charts(&no_metric),
            Err(PlotError::NoMetric {
                metric: "/round_trips_per_s",
                ..
            })
        ));
    }

    #[test]
    fn si_formats_each_range() {
        assert_eq!(si(3_456_789.0), "3.46M");
        assert_eq!(si(45_678.0), "45.7k");
        assert_eq!(si(512.4), "512");
        assert_eq!(si(12.34), "12.3");
        assert_eq!(si(0.456), "0.46");
        assert_eq!(si(0.0), "0");
    }
}
