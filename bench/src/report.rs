//! Aggregates study outcomes into a markdown table and a PNG chart.

use std::path::Path;

use anyhow::{Result, anyhow};
use plotters::prelude::*;

use crate::contention::{Outcome, Strategy};

/// Outcomes of one strategy at one writer count, over repetitions.
pub struct Cell {
    pub strategy: Strategy,
    pub writers: u32,
    pub runs: Vec<Outcome>,
}

fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() { 0.0 } else { xs.iter().sum::<f64>() / xs.len() as f64 }
}

fn stddev(xs: &[f64]) -> f64 {
    if xs.len() < 2 {
        return 0.0;
    }
    let m = mean(xs);
    (xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (xs.len() - 1) as f64).sqrt()
}

impl Cell {
    fn series(&self, f: impl Fn(&Outcome) -> f64) -> Vec<f64> {
        self.runs.iter().map(f).collect()
    }
    pub fn wall_mean(&self) -> f64 {
        mean(&self.series(|o| o.wall.as_secs_f64()))
    }
    pub fn lost_mean(&self) -> f64 {
        mean(&self.series(|o| o.lost_windows as f64))
    }
    pub fn duplicated(&self) -> u64 {
        self.runs.iter().map(|o| o.duplicated_rows).max().unwrap_or(0)
    }
}

/// The markdown table: mean ± standard deviation over repetitions.
pub fn markdown(cells: &[Cell]) -> String {
    let mut out = String::from(
        "| strategy | W | wall time (s) | commit attempts | conflicts | windows lost | rows landed / expected | duplicated rows |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for c in cells {
        let pm = |f: &dyn Fn(&Outcome) -> f64, digits: usize| {
            let s = c.series(f);
            format!("{:.*} ± {:.*}", digits, mean(&s), digits, stddev(&s))
        };
        let landed = mean(&c.series(|o| o.rows_landed as f64));
        let expected = c.runs.first().map_or(0, |o| o.rows_expected);
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {:.0} / {} | {} |\n",
            c.strategy.name(),
            c.writers,
            pm(&|o| o.wall.as_secs_f64(), 2),
            pm(&|o| o.attempts as f64, 0),
            pm(&|o| o.conflicts as f64, 0),
            pm(&|o| o.lost_windows as f64, 1),
            landed,
            expected,
            c.duplicated(),
        ));
    }
    out
}

const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

/// Two bar charts side by side: mean wall time and mean lost windows per
/// strategy, one bar per writer count.
pub fn chart(cells: &[Cell], writers: &[u32], path: &Path) -> Result<()> {
    let font =
        std::fs::read(FONT).map_err(|e| anyhow!("the chart needs {FONT} (apt-get install fonts-dejavu-core): {e}"))?;
    let font: &'static [u8] = Box::leak(font.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, font)
        .map_err(|_| anyhow!("{FONT} is not a usable font"))?;
    let root = BitMapBackend::new(path, (1200, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let (left, right) = root.split_horizontally(600);
    let strategies: Vec<Strategy> = Strategy::ALL.to_vec();
    let colors = [RGBColor(66, 133, 244), RGBColor(219, 68, 55), RGBColor(15, 157, 88)];
    for (area, title, value) in [
        (&left, "wall time (s, mean)", &(|c: &Cell| c.wall_mean()) as &dyn Fn(&Cell) -> f64),
        (&right, "windows lost (mean)", &(|c: &Cell| c.lost_mean()) as &dyn Fn(&Cell) -> f64),
    ] {
        let max = cells.iter().map(value).fold(0.0f64, f64::max).max(1.0) * 1.15;
        let mut chart = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 22))
            .margin(15)
            .x_label_area_size(35)
            .y_label_area_size(50)
            .build_cartesian_2d(0f64..strategies.len() as f64, 0f64..max)
            .map_err(|e| anyhow!("{e}"))?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            // Ticks every half unit; only the group centres (i + 0.5) are named.
            .x_labels(strategies.len() * 2 + 1)
            .x_label_formatter(&|x| {
                if (x.fract() - 0.5).abs() > 0.01 {
                    return String::new();
                }
                strategies.get(x.floor() as usize).map_or(String::new(), |s| s.name().to_string())
            })
            .draw()
            .map_err(|e| anyhow!("{e}"))?;
        let width = 0.8 / writers.len().max(1) as f64;
        for (wi, w) in writers.iter().enumerate() {
            let color = colors[wi % colors.len()];
            let bars = strategies.iter().enumerate().filter_map(|(si, s)| {
                let cell = cells.iter().find(|c| c.strategy == *s && c.writers == *w)?;
                let x0 = si as f64 + 0.1 + wi as f64 * width;
                Some(Rectangle::new([(x0, 0.0), (x0 + width * 0.95, value(cell))], color.filled()))
            });
            chart
                .draw_series(bars)
                .map_err(|e| anyhow!("{e}"))?
                .label(format!("W = {w}"))
                .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], color.filled()));
        }
        chart
            .configure_series_labels()
            .border_style(BLACK)
            .background_style(WHITE.mix(0.8))
            .draw()
            .map_err(|e| anyhow!("{e}"))?;
    }
    root.present().map_err(|e| anyhow!("{e}"))?;
    Ok(())
}
