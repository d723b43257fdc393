//! Human tables, medians and the JSON results file.

use std::path::Path;

use comfy_table::presets::UTF8_FULL_CONDENSED;
use comfy_table::{Cell, CellAlignment, Table};

/// The median of `values` (mean of the middle two for an even count); `None` if empty.
pub fn median(values: &[f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    Some(if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    })
}

/// A table with the given header, right-aligning numeric-looking cells.
pub fn table(header: &[&str], rows: Vec<Vec<String>>) -> Table {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header(header.iter().map(Cell::new));
    for row in rows {
        t.add_row(row.into_iter().map(|c| {
            let numeric = c.chars().next().is_some_and(|ch| ch.is_ascii_digit());
            let cell = Cell::new(c);
            if numeric {
                cell.set_alignment(CellAlignment::Right)
            } else {
                cell
            }
        }));
    }
    t
}

/// Formats an integer with thousands separators: `12,345,678`.
pub fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

/// Writes `rows` as a pretty JSON array.
///
/// # Errors
/// If the file cannot be written.
pub fn write_json(path: &Path, rows: &[serde_json::Value]) -> std::io::Result<()> {
    let text = serde_json::to_string_pretty(rows).map_err(std::io::Error::other)?;
    std::fs::write(path, text + "\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_thousands() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(&[]), None);
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(1234567), "1,234,567");
        assert_eq!(thousands(123), "123");
    }
}
