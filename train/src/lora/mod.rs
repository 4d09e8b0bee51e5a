//! LoRA runs: adapters on a frozen base, their files, the base weights.

pub(crate) mod adapter_file;
pub(crate) mod base_weights;
pub(crate) mod lora_run;
