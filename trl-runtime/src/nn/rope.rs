//! Rotary position embeddings with HF's rope scaling kinds (default, linear, dynamic NTK,
//! llama3, yarn), indexed by position ids so that packed documents restart at position 0.

use candle_core::{DType, Device, Result, Tensor};
use serde::{Deserialize, Serialize};
use std::sync::{Arc, Mutex};

/// `rope_scaling` of an HF config.json. HF writes the kind as `rope_type` (older: `type`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RopeScaling {
    #[serde(alias = "type", default = "default_rope_type")]
    pub rope_type: String,
    /// transformers >= 5 keeps the base here (`rope_parameters`); older configs at top level.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub factor: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub low_freq_factor: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub high_freq_factor: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub original_max_position_embeddings: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub beta_fast: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub beta_slow: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_factor: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub truncate: Option<bool>,
    /// longrope's per-frequency divisors for rows within / beyond the original length.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub short_factor: Option<Vec<f64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub long_factor: Option<Vec<f64>>,
    /// Keys this code does not read, kept so a saved config.json carries them.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// YaRN's magnitude correction for a context `factor` times longer, with DeepSeek's gain `m`
/// (transformers' `get_mscale`): 1 when the context is not longer.
pub fn yarn_mscale(factor: f64, m: f64) -> f64 {
    match factor <= 1.0 {
        true => 1.0,
        false => 0.1 * m * factor.ln() + 1.0,
    }
}

fn default_rope_type() -> String {
    "default".into()
}

pub const ROPE_TYPES: &[&str] = &[
    "default",
    "linear",
    "dynamic",
    "llama3",
    "yarn",
    "longrope",
    "proportional",
];

/// longrope (Phi-3's): the frequencies divided by `short` while a forward's positions stay
/// within `original` tokens, by `long` beyond.
#[derive(Debug, Clone)]
struct LongRope {
    short: Vec<f64>,
    long: Vec<f64>,
    original: usize,
}

#[derive(Debug, Clone)]
pub struct RotaryEmbedding {
    inv_freq: Vec<f64>,
    /// Multiplies cos and sin (yarn's attention factor; 1 otherwise).
    attention_scaling: f64,
    /// Dynamic NTK: (factor, max_position_embeddings, base) to rescale for longer inputs.
    dynamic: Option<(f64, usize, f64)>,
    longrope: Option<LongRope>,
    head_dim: usize,
    /// cos and sin by position, kept between forwards: a forward gathers its rows instead of
    /// computing b x s x head_dim / 2 sines and cosines on the host (16 ms at 8 x 2048, head
    /// dim 64, while the GPU waits for the step's first kernels).
    table: Arc<Mutex<Option<Table>>>,
}

/// [`RotaryEmbedding`]'s cos and sin for positions 0..rows, [rows, head_dim] in the compute
/// dtype on the compute device, for one set of frequencies.
#[derive(Debug)]
struct Table {
    inv_freq: Vec<f64>,
    rows: usize,
    device: Device,
    dtype: DType,
    cos: Tensor,
    sin: Tensor,
}

fn base_inv_freq(base: f64, dim: usize) -> Vec<f64> {
    (0..dim / 2)
        .map(|i| 1.0 / base.powf((2 * i) as f64 / dim as f64))
        .collect()
}

impl RotaryEmbedding {
    /// `Err` names the problem in config.json terms.
    pub fn new(
        head_dim: usize,
        rope_theta: f64,
        max_position_embeddings: usize,
        scaling: Option<&RopeScaling>,
    ) -> std::result::Result<Self, String> {
        let mut rope = RotaryEmbedding {
            inv_freq: base_inv_freq(rope_theta, head_dim),
            attention_scaling: 1.0,
            dynamic: None,
            longrope: None,
            head_dim,
            table: Arc::default(),
        };
        let Some(s) = scaling else { return Ok(rope) };
        let factor = || {
            s.factor
                .ok_or_else(|| format!("rope_scaling of type {} needs `factor`", s.rope_type))
        };
        match s.rope_type.as_str() {
            "default" => {}
            "linear" => {
                let f = factor()?;
                rope.inv_freq.iter_mut().for_each(|v| *v /= f);
            }
            "dynamic" => rope.dynamic = Some((factor()?, max_position_embeddings, rope_theta)),
            // Gemma 4's global layers: the first `partial_rotary_factor` of the frequency
            // pairs at the head's rates, the rest zero (those pairs left unrotated), the
            // rotation still over the whole head.
            "proportional" => {
                let share = s
                    .extra
                    .get("partial_rotary_factor")
                    .and_then(|v| v.as_f64())
                    .unwrap_or(1.0);
                if !(0.0..=1.0).contains(&share) {
                    return Err(format!(
                        "partial_rotary_factor {share}: a share of the head between 0 and 1"
                    ));
                }
                let rotated = (share * head_dim as f64 / 2.0) as usize;
                let f = s.factor.unwrap_or(1.0);
                for (i, v) in rope.inv_freq.iter_mut().enumerate() {
                    *v = if i < rotated { *v / f } else { 0.0 };
                }
            }
            "llama3" => {
                let f = factor()?;
                let low = s.low_freq_factor.unwrap_or(1.0);
                let high = s.high_freq_factor.unwrap_or(4.0);
                let original = s.original_max_position_embeddings.unwrap_or(8192) as f64;
                let (low_wavelen, high_wavelen) = (original / low, original / high);
                for v in rope.inv_freq.iter_mut() {
                    let wavelen = 2.0 * std::f64::consts::PI / *v;
                    if wavelen > low_wavelen {
                        *v /= f;
                    } else if wavelen >= high_wavelen {
                        let smooth = (original / wavelen - low) / (high - low);
                        *v = (1.0 - smooth) * *v / f + smooth * *v;
                    }
                }
            }
            "yarn" => {
                let f = factor()?;
                let original = s
                    .original_max_position_embeddings
                    .unwrap_or(max_position_embeddings) as f64;
                let (beta_fast, beta_slow) =
                    (s.beta_fast.unwrap_or(32.0), s.beta_slow.unwrap_or(1.0));
                let dim = head_dim as f64;
                let correction = |rotations: f64| {
                    dim * (original / (rotations * 2.0 * std::f64::consts::PI)).ln()
                        / (2.0 * rope_theta.ln())
                };
                let (mut low, mut high) = (correction(beta_fast), correction(beta_slow));
                if s.truncate.unwrap_or(true) {
                    low = low.floor();
                    high = high.ceil();
                }
                let low = low.max(0.0);
                let high = high.min(dim - 1.0);
                let high = if (high - low).abs() < f64::EPSILON {
                    high + 0.001
                } else {
                    high
                };
                let extrapolation = base_inv_freq(rope_theta, head_dim);
                rope.inv_freq = extrapolation
                    .iter()
                    .enumerate()
                    .map(|(i, &extra)| {
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrapolation_factor = 1.0 - ramp;
                        (extra / f) * (1.0 - extrapolation_factor) + extra * extrapolation_factor
                    })
                    .collect();
                // DeepSeek's `mscale` / `mscale_all_dim`: their ratio when both are set.
                let mscale = |m: f64| yarn_mscale(f, m);
                let key = |k: &str| {
                    s.extra
                        .get(k)
                        .and_then(|v| v.as_f64())
                        .filter(|&m| m != 0.0)
                };
                rope.attention_scaling =
                    s.attention_factor
                        .unwrap_or(match (key("mscale"), key("mscale_all_dim")) {
                            (Some(m), Some(all)) => mscale(m) / mscale(all),
                            _ => mscale(1.0),
                        });
            }
            "longrope" => {
                let original = s.original_max_position_embeddings.ok_or(
                    "rope_scaling of type longrope needs `original_max_position_embeddings`",
                )?;
                let half = head_dim / 2;
                let factors = |f: &Option<Vec<f64>>, key: &str| match f {
                    Some(f) if f.len() == half => Ok(f.clone()),
                    Some(f) => Err(format!(
                        "longrope's {key} has {} values: give one per rotary frequency ({half})",
                        f.len()
                    )),
                    None => Err(format!("rope_scaling of type longrope needs `{key}`")),
                };
                let (short, long) = (
                    factors(&s.short_factor, "short_factor")?,
                    factors(&s.long_factor, "long_factor")?,
                );
                // transformers: the factor defaults to the ratio of the lengths.
                let f = s
                    .factor
                    .unwrap_or(max_position_embeddings as f64 / original as f64);
                rope.attention_scaling = s.attention_factor.unwrap_or(if f <= 1.0 {
                    1.0
                } else {
                    (1.0 + f.ln() / (original as f64).ln()).sqrt()
                });
                rope.longrope = Some(LongRope {
                    short,
                    long,
                    original,
                });
            }
            other => {
                return Err(format!(
                    "rope_scaling type '{other}' is not supported: use one of {}",
                    ROPE_TYPES.join(", ")
                ))
            }
        }
        Ok(rope)
    }

    /// Whether the tables depend on the largest position of the forward (dynamic NTK,
    /// longrope): under a sequence split it must be the whole sequence's
    /// ([`Self::cos_sin_within`]).
    pub fn depends_on_length(&self) -> bool {
        self.dynamic.is_some() || self.longrope.is_some()
    }

    /// cos and sin, each [batch, seq, head_dim], for integer `position_ids` [batch, seq].
    pub fn cos_sin(
        &self,
        position_ids: &Tensor,
        dtype: DType,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        self.cos_sin_within(position_ids, None, dtype, device)
    }

    /// [`Self::cos_sin`] for part of a sequence whose largest position is `max_position`
    /// (None: the largest of `position_ids`).
    pub fn cos_sin_within(
        &self,
        position_ids: &Tensor,
        max_position: Option<i64>,
        dtype: DType,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let (b, s) = position_ids.dims2()?;
        let flat: Vec<i64> = position_ids
            .to_dtype(DType::I64)?
            .flatten_all()?
            .to_vec1()?;
        let ids = Tensor::from_vec(
            flat.iter().map(|&p| p.max(0) as u32).collect::<Vec<_>>(),
            b * s,
            device,
        )?;
        self.cos_sin_at((&flat, &ids), (b, s), max_position, dtype, device)
    }

    /// [`Self::cos_sin_within`] of positions known on the host (`flat`, [b x s]) whose
    /// table rows `ids` (u32 [b x s] on `device`) gathers: nothing is read back or uploaded
    /// (generation's fixed steps, where `ids` is a buffer a CUDA graph reads).
    pub fn cos_sin_at(
        &self,
        (flat, ids): (&[i64], &Tensor),
        (b, s): (usize, usize),
        max_position: Option<i64>,
        dtype: DType,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        if flat.is_empty() {
            let empty = Tensor::zeros((b, s, self.head_dim), dtype, device)?;
            return Ok((empty.clone(), empty));
        }
        let (lowest, highest) = flat
            .iter()
            .fold((i64::MAX, i64::MIN), |(lo, hi), &p| (lo.min(p), hi.max(p)));
        if lowest < 0 {
            candle_core::bail!("rotary embedding: position {lowest} is negative");
        }
        let seq_len = max_position.unwrap_or(highest).max(0) as usize + 1;
        let inv_freq = match (self.dynamic, &self.longrope) {
            (_, Some(l)) => {
                let factors = if seq_len > l.original {
                    &l.long
                } else {
                    &l.short
                };
                self.inv_freq
                    .iter()
                    .zip(factors)
                    .map(|(f, e)| f / e)
                    .collect()
            }
            (Some((factor, max_pos, base)), None) => {
                if seq_len > max_pos {
                    let d = self.head_dim as f64;
                    let scaled = base
                        * ((factor * seq_len as f64 / max_pos as f64) - (factor - 1.0))
                            .powf(d / (d - 2.0));
                    base_inv_freq(scaled, self.head_dim)
                } else {
                    self.inv_freq.clone()
                }
            }
            (None, None) => self.inv_freq.clone(),
        };
        // The table's rows: a part of a sequence may be told a smaller largest position.
        let rows_needed = seq_len.max(highest as usize + 1);
        let mut cached = self.table.lock().unwrap_or_else(|e| e.into_inner());
        let fits = |t: &Table| {
            t.inv_freq == inv_freq
                && t.rows >= rows_needed
                && t.dtype == dtype
                && t.device.same_device(device)
        };
        let table = match cached.take().filter(fits) {
            Some(table) => table,
            None => {
                // Grown to a power of two: a run of rising lengths rebuilds it a few times.
                let rows = rows_needed.next_power_of_two();
                let (cos, sin) = self.rows_of(&inv_freq, rows, dtype, device)?;
                Table {
                    inv_freq,
                    rows,
                    device: device.clone(),
                    dtype,
                    cos,
                    sin,
                }
            }
        };
        let gather = |t: &Tensor| t.index_select(ids, 0)?.reshape((b, s, self.head_dim));
        let out = (gather(&table.cos)?, gather(&table.sin)?);
        *cached = Some(table);
        Ok(out)
    }

    /// cos and sin of positions 0..rows, [rows, head_dim] each, in `dtype` on `device`.
    fn rows_of(
        &self,
        inv_freq: &[f64],
        rows: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let half = self.head_dim / 2;
        let mut cos = Vec::with_capacity(rows * self.head_dim);
        let mut sin = Vec::with_capacity(rows * self.head_dim);
        for p in 0..rows {
            // HF computes the angles in fp32; match it so parity holds at long positions.
            let angles: Vec<f32> = inv_freq.iter().map(|f| (p as f32) * (*f as f32)).collect();
            for _ in 0..2 {
                cos.extend(
                    angles[..half]
                        .iter()
                        .map(|a| a.cos() * self.attention_scaling as f32),
                );
                sin.extend(
                    angles[..half]
                        .iter()
                        .map(|a| a.sin() * self.attention_scaling as f32),
                );
            }
        }
        let cos = Tensor::from_vec(cos, (rows, self.head_dim), device)?.to_dtype(dtype)?;
        let sin = Tensor::from_vec(sin, (rows, self.head_dim), device)?.to_dtype(dtype)?;
        Ok((cos, sin))
    }
}

pub use crate::kernels::fused::apply_rotary;

#[cfg(test)]
mod tests {
    use super::*;

    /// longrope divides by the short factors while the largest position stays within the
    /// original length, by the long ones beyond, and scales by its attention factor; a part
    /// of a sequence follows the largest position it is given.
    #[test]
    fn longrope_picks_its_factors_by_length() {
        let scaling = RopeScaling {
            rope_type: "longrope".into(),
            original_max_position_embeddings: Some(8),
            short_factor: Some(vec![2.0, 1.0]),
            long_factor: Some(vec![4.0, 1.0]),
            ..serde_json::from_str(r#"{"rope_type": "longrope"}"#).unwrap()
        };
        let rope = RotaryEmbedding::new(4, 10000.0, 32, Some(&scaling)).unwrap();
        let scale = (1.0 + 4f64.ln() / 8f64.ln()).sqrt();
        let pos = Tensor::new(&[[1i64, 2]], &Device::Cpu).unwrap();
        let cos0 = |max: Option<i64>| -> f64 {
            let (cos, _) = rope
                .cos_sin_within(&pos, max, DType::F64, &Device::Cpu)
                .unwrap();
            cos.flatten_all().unwrap().to_vec1::<f64>().unwrap()[0]
        };
        assert!((cos0(None) - (1.0f64 / 2.0).cos() * scale).abs() < 1e-6);
        assert!((cos0(Some(20)) - (1.0f64 / 4.0).cos() * scale).abs() < 1e-6);
        // A factor list of the wrong length is named.
        let bad = RopeScaling {
            short_factor: Some(vec![1.0]),
            ..scaling
        };
        let e = RotaryEmbedding::new(4, 10000.0, 32, Some(&bad)).unwrap_err();
        assert!(e.contains("short_factor"), "{e}");
    }

    /// The kept table gives what the definition gives: packed rows restarting at 0, a later
    /// forward reaching past the table (it grows), another dtype and, for dynamic NTK,
    /// frequencies that change with the length.
    #[test]
    fn kept_table_gives_the_definition() {
        let direct = |rope: &RotaryEmbedding, rows: &[Vec<i64>], inv_freq: &[f64]| {
            let mut cos = Vec::new();
            for &p in rows.iter().flatten() {
                let angles: Vec<f32> = inv_freq.iter().map(|f| p as f32 * *f as f32).collect();
                for _ in 0..2 {
                    cos.extend(
                        angles
                            .iter()
                            .map(|a| a.cos() * rope.attention_scaling as f32),
                    );
                }
            }
            cos
        };
        let scaling: RopeScaling =
            serde_json::from_str(r#"{"rope_type": "dynamic", "factor": 2.0}"#).unwrap();
        for scaling in [None, Some(&scaling)] {
            let rope = RotaryEmbedding::new(8, 10000.0, 16, scaling).unwrap();
            for (rows, dtype) in [
                (
                    vec![vec![0i64, 1, 2, 0, 1], vec![0, 1, 2, 3, 4]],
                    DType::F32,
                ),
                (vec![vec![3i64, 9, 2, 11, 0]], DType::F32),
                (vec![vec![30i64, 7, 31, 0, 5]], DType::F64),
                (vec![vec![1i64, 2, 0, 1, 2]], DType::F64),
            ] {
                let pos = Tensor::new(rows.clone(), &Device::Cpu).unwrap();
                let (cos, _) = rope.cos_sin(&pos, dtype, &Device::Cpu).unwrap();
                assert_eq!((cos.dims(), cos.dtype()), (&[rows.len(), 5, 8][..], dtype));
                let got = cos.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
                let longest = *rows.iter().flatten().max().unwrap() as usize + 1;
                let inv_freq = match rope.dynamic {
                    Some((f, max, base)) if longest > max => {
                        let scaled =
                            base * ((f * longest as f64 / max as f64) - (f - 1.0)).powf(8.0 / 6.0);
                        base_inv_freq(scaled, 8)
                    }
                    _ => rope.inv_freq.clone(),
                };
                let want = direct(&rope, &rows, &inv_freq);
                assert_eq!(got.to_vec1::<f32>().unwrap(), want, "{rows:?} {dtype:?}");
            }
        }
    }

    /// The table is kept: a forward within its rows gathers from the same table, one past
    /// them or in another dtype builds a new one.
    #[test]
    fn table_is_kept_between_forwards() {
        let rope = RotaryEmbedding::new(8, 10000.0, 64, None).unwrap();
        let table = || {
            let t = rope.table.lock().unwrap();
            t.as_ref().map(|t| (t.cos.id(), t.rows))
        };
        let forward = |rows: Vec<Vec<i64>>, dtype| {
            let pos = Tensor::new(rows, &Device::Cpu).unwrap();
            rope.cos_sin(&pos, dtype, &Device::Cpu).unwrap();
        };
        forward(vec![vec![0, 1, 2, 3, 4]], DType::F32);
        let first = table().unwrap();
        assert_eq!(first.1, 8, "grown to a power of two past position 4");
        forward(vec![vec![7, 0, 1, 2, 3]], DType::F32);
        assert_eq!(table().unwrap(), first, "within the rows: the same table");
        forward(vec![vec![8, 0, 1, 2, 3]], DType::F32);
        let grown = table().unwrap();
        assert_eq!(grown.1, 16);
        forward(vec![vec![8, 0, 1, 2, 3]], DType::F64);
        assert_ne!(table().unwrap().0, grown.0, "another dtype: another table");
    }
}
