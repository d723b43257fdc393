//! `railyard bench plot`: SVG charts of the result files the scenarios write
//! with `--json` (drawn by `railyard_bench::plot`).

use std::path::{Path, PathBuf};

use anyhow::Context;

/// Options for `railyard bench plot`.
#[derive(Debug, clap::Args)]
pub(crate) struct PlotArgs {
    /// Result files written by `railyard bench <scenario> --json FILE`, one
    /// scenario per file.
    #[arg(required = true, value_name = "FILE.json")]
    files: Vec<PathBuf>,
    /// Directory for the charts (default: beside each input file). Each
    /// input `NAME.json` gives `NAME.svg` and, for scenarios that measure
    /// latency, `NAME-latency.svg`.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
}

pub(crate) fn run(a: &PlotArgs) -> anyhow::Result<()> {
    if let Some(dir) = &a.out {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating the output directory {}", dir.display()))?;
    }
    for file in &a.files {
        let text =
            std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        let rows: Vec<serde_json::Value> = serde_json::from_str(&text).with_context(|| {
            format!(
                "{} is not a JSON array of result rows (write one with `railyard bench <scenario> --json FILE`)",
                file.display()
            )
        })?;
        let charts = railyard_bench::plot::charts(&rows)
            .with_context(|| format!("plotting {}", file.display()))?;
        let stem = file
            .file_stem()
            .map_or_else(|| "results".into(), |s| s.to_string_lossy().into_owned());
        let dir = a
            .out
            .clone()
            .or_else(|| file.parent().map(Path::to_path_buf))
            .unwrap_or_default();
        for c in charts {
            let path = dir.join(format!("{stem}{}.svg", c.suffix));
            std::fs::write(&path, &c.svg).with_context(|| format!("writing {}", path.display()))?;
            println!("{}: {}", path.display(), c.title);
        }
    }
    Ok(())
}

/// The line every scenario prints after writing its `--json` file.
pub(crate) fn announce_json(path: &Path, rows: usize) {
    eprintln!(
        "wrote {rows} result rows to {p} (charts: railyard bench plot {p})",
        p = path.display()
    );
}
