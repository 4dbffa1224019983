//! The loss curve as an SVG (training loss per step, eval loss where measured).

use crate::error::{Error, Result};
use plotters::prelude::*;
use std::path::Path;

pub fn loss_curve(path: &Path, train: &[(f64, f64)], history: &[serde_json::Value]) -> Result<()> {
    let eval: Vec<(f64, f64)> = history
        .iter()
        .filter_map(|h| Some((h.get("step")?.as_f64()?, h.get("eval_loss")?.as_f64()?)))
        .collect();
    let fail = |e: String| {
        Error::io(
            format!("cannot draw {}", path.display()),
            std::io::Error::other(e),
        )
    };
    let x_max = train.iter().map(|p| p.0).fold(1.0, f64::max);
    let y_max = train
        .iter()
        .chain(&eval)
        .map(|p| p.1)
        .filter(|v| v.is_finite())
        .fold(0.1, f64::max)
        * 1.05;
    let root = SVGBackend::new(path, (900, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(e.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption("loss", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(52)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)
        .map_err(|e| fail(e.to_string()))?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("loss")
        .draw()
        .map_err(|e| fail(e.to_string()))?;
    chart
        .draw_series(LineSeries::new(train.iter().copied(), &BLUE))
        .map_err(|e| fail(e.to_string()))?
        .label("train")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], BLUE));
    if !eval.is_empty() {
        chart
            .draw_series(LineSeries::new(eval.iter().copied(), RED.stroke_width(2)))
            .map_err(|e| fail(e.to_string()))?
            .label("eval")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], RED));
    }
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()
        .map_err(|e| fail(e.to_string()))?;
    root.present().map_err(|e| fail(e.to_string()))?;
    Ok(())
}
