//! MXFP4 checkpoints, as the hub ships gpt-oss: each expert tensor `X` is stored as
//! `X_blocks` (u8 [experts, rows, groups, 16]: two 4-bit e2m1 values per byte, low nibble
//! first, 32 per group) and `X_scales` (u8 [experts, rows, groups]: a power of two, biased by
//! 127), transposed from the layout the model uses. Training needs the weights dequantized, as
//! TRL's gpt-oss recipe loads them (`Mxfp4Config(dequantize=True)`): `WeightFiles` reads `X`
//! from the pair, whole (a layer's expert tensor at a time), the checkpoints we write are
//! dense, and their config.json drops `quantization_config` ([`dense_config`]).

use candle_core::{Result, Tensor};

/// The suffixes of a packed tensor's two parts.
pub const BLOCKS: &str = "_blocks";
pub const SCALES: &str = "_scales";

/// The e2m1 values of the 16 nibbles (transformers' FP4_VALUES).
const FP4: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// The dense shape of a tensor whose blocks have shape `blocks` [experts, rows, groups, bytes]:
/// [experts, groups x bytes x 2, rows] (transformers' `convert_moe_packed_tensors`).
pub fn dense_shape(blocks: &[usize]) -> Option<Vec<usize>> {
    match blocks {
        [e, rows, groups, bytes] => Some(vec![*e, groups * bytes * 2, *rows]),
        _ => None,
    }
}

/// The dense f32 tensor of `blocks` and `scales` (on the CPU), as transformers dequantizes:
/// value = e2m1(nibble) x 2^(scale - 127), then rows and columns of each expert swapped.
pub fn dequantize(blocks: &Tensor, scales: &Tensor) -> Result<Tensor> {
    let dims = blocks.dims().to_vec();
    let Some(shape) = dense_shape(&dims) else {
        candle_core::bail!("MXFP4 blocks of shape {dims:?}: expected [experts, rows, groups, 16]")
    };
    if scales.dims() != &dims[..3] {
        candle_core::bail!(
            "MXFP4 scales of shape {:?} do not match blocks of shape {dims:?}",
            scales.dims()
        );
    }
    let bytes: Vec<u8> = blocks.flatten_all()?.to_vec1()?;
    let exps: Vec<u8> = scales.flatten_all()?.to_vec1()?;
    let per_group = dims[3];
    let mut out = Vec::with_capacity(bytes.len() * 2);
    for (group, &e) in bytes.chunks(per_group).zip(&exps) {
        let scale = 2f32.powi(e as i32 - 127);
        for &b in group {
            out.push(FP4[(b & 0x0f) as usize] * scale);
            out.push(FP4[(b >> 4) as usize] * scale);
        }
    }
    let (experts, cols, rows) = (shape[0], shape[1], shape[2]);
    Tensor::from_vec(out, (experts, rows, cols), blocks.device())?
        .transpose(1, 2)?
        .contiguous()
}

/// `config.json`'s text without an MXFP4 `quantization_config` (the weights we hold and write
/// are dense); other texts unchanged.
pub fn dense_config(text: &str) -> String {
    let Ok(serde_json::Value::Object(mut map)) = serde_json::from_str(text) else {
        return text.to_string();
    };
    let mxfp4 = map
        .get("quantization_config")
        .and_then(|q| q.get("quant_method"))
        .and_then(|m| m.as_str())
        == Some("mxfp4");
    if !mxfp4 {
        return text.to_string();
    }
    map.remove("quantization_config");
    serde_json::to_string_pretty(&serde_json::Value::Object(map)).unwrap_or_else(|_| text.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// One expert, one row of one 32-value group: nibbles low then high, the scale applied,
    /// rows and columns swapped; a config loses its MXFP4 quantization and nothing else.
    #[test]
    fn dequantizes_as_transformers_lays_it_out() {
        let dev = Device::Cpu;
        // Row 0: bytes 0x21 (0.5 then 1.0), 0xF7 (6.0 then -6.0), then zeros, scale 2; row 1:
        // every nibble -0.5, scale 1/2.
        let mut row = vec![0u8; 16];
        row[0] = 0x21;
        row[1] = 0xF7;
        let mut b = row.clone();
        b.extend(vec![0x99u8; 16]);
        let blocks = Tensor::from_vec(b, (1, 2, 1, 16), &dev).unwrap();
        let scales = Tensor::from_vec(vec![128u8, 126], (1, 2, 1), &dev).unwrap();
        let w = dequantize(&blocks, &scales).unwrap();
        assert_eq!(w.dims(), &[1, 32, 2]);
        let w: Vec<Vec<f32>> = w.squeeze(0).unwrap().to_vec2().unwrap();
        assert_eq!(&w[0], &[1.0, -0.25]);
        assert_eq!(&w[1], &[2.0, -0.25]);
        assert_eq!(&w[2], &[12.0, -0.25]);
        assert_eq!(&w[3], &[-12.0, -0.25]);
        let text = r#"{"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}}"#;
        let dense: serde_json::Value = serde_json::from_str(&dense_config(text)).unwrap();
        assert_eq!(dense, serde_json::json!({"model_type": "gpt_oss"}));
        let other = r#"{"quantization_config": {"quant_method": "bitsandbytes"}}"#;
        assert_eq!(dense_config(other), other);
    }
}
