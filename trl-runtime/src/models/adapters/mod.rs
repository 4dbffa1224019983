//! LoRA adapters in peft's format (`peft`, fused experts in `peft_experts`) and merging them
//! into the base (`merge`).

pub mod merge;
pub mod peft;
pub mod peft_experts;
