//! Weights in Hugging Face layout: a model's parameters read from and written to safetensors
//! (`params`, `tensor_file`), MXFP4 experts read dequantized, composite (vision-language)
//! checkpoints read on text.

pub mod composite;
pub mod mxfp4;
pub mod params;
pub mod tensor_file;
