//! The adapter settings diffusers writes into a LoRA file's safetensors metadata: under
//! `lora_adapter_metadata`, a JSON object of PEFT's `LoraConfig` fields, each key prefixed with
//! its component (`transformer.lora_alpha`; bare keys when a model saved its own adapter). They
//! decide each module's scale (`lora_alpha / r`, per module through `alpha_pattern`) for files
//! without `alpha` tensors, as diffusers' loader applies them.

use std::collections::BTreeMap;

use serde_json::{Map, Value};

/// The safetensors metadata key diffusers stores the adapter configuration under.
pub const METADATA_KEY: &str = "lora_adapter_metadata";

/// The component whose settings a transformer's adapters take.
const COMPONENT: &str = "transformer.";

/// The scale-deciding fields of a PEFT `LoraConfig`.
#[derive(Debug, Clone, PartialEq)]
pub struct PeftConfig {
    /// Default `α` of every module.
    pub lora_alpha: f64,
    /// `(module pattern, α)` overrides: a pattern selects a module whose name is it or ends
    /// with `.` and it (PEFT's rule for plain names).
    pub alpha_pattern: Vec<(String, f64)>,
    /// Rank-stabilised scaling: `α / √r` instead of `α / r`.
    pub use_rslora: bool,
}

impl PeftConfig {
    /// The transformer's settings in a file's safetensors `metadata`; `None` when the file
    /// carries none. Fails on malformed JSON or on an adapter that is not plain LoRA (DoRA).
    pub fn from_metadata(metadata: &BTreeMap<String, String>) -> Result<Option<Self>, String> {
        let Some(text) = metadata.get(METADATA_KEY) else {
            return Ok(None);
        };
        let json: Map<String, Value> = serde_json::from_str(text)
            .map_err(|e| format!("metadata `{METADATA_KEY}` is not a JSON object: {e}"))?;
        let prefixed = json.keys().any(|k| k.starts_with(COMPONENT));
        let field = |name: &str| {
            let key = if prefixed {
                format!("{COMPONENT}{name}")
            } else {
                name.to_string()
            };
            json.get(&key)
        };
        if field("use_dora").and_then(Value::as_bool) == Some(true) {
            return Err(format!(
                "metadata `{METADATA_KEY}` says use_dora: DoRA adapters (a magnitude vector \
                 besides B·A) cannot be imported as LoRA"
            ));
        }
        let Some(alpha) = field("lora_alpha") else {
            return Ok(None);
        };
        let number = |v: &Value, what: &str| {
            v.as_f64()
                .filter(|a| a.is_finite() && *a > 0.0)
                .ok_or_else(|| {
                    format!("metadata `{METADATA_KEY}`: {what} = {v} is not a positive number")
                })
        };
        let lora_alpha = number(alpha, "lora_alpha")?;
        let alpha_pattern = match field("alpha_pattern") {
            Some(Value::Object(patterns)) => patterns
                .iter()
                .map(|(k, v)| Ok((k.clone(), number(v, &format!("alpha_pattern[{k:?}]"))?)))
                .collect::<Result<_, String>>()?,
            _ => Vec::new(),
        };
        Ok(Some(Self {
            lora_alpha,
            alpha_pattern,
            use_rslora: field("use_rslora").and_then(Value::as_bool) == Some(true),
        }))
    }

    /// The factor of `B · A` for the adapter of `module` (diffusers' module name, without the
    /// component prefix) at rank `rank`.
    pub fn scale(&self, module: &str, rank: i64) -> f64 {
        let alpha = self
            .alpha_pattern
            .iter()
            .find(|(p, _)| module == p || module.ends_with(&format!(".{p}")))
            .map_or(self.lora_alpha, |&(_, a)| a);
        let rank = rank as f64;
        alpha / if self.use_rslora { rank.sqrt() } else { rank }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metadata(json: &str) -> BTreeMap<String, String> {
        BTreeMap::from([(METADATA_KEY.to_string(), json.to_string())])
    }

    #[test]
    fn prefixed_alpha_and_patterns_decide_the_scale() {
        let config = PeftConfig::from_metadata(&metadata(
            r#"{"transformer.r": 4, "transformer.lora_alpha": 8,
                "transformer.alpha_pattern": {"attn.to_q": 2}, "text_encoder.lora_alpha": 1}"#,
        ))
        .unwrap()
        .unwrap();
        assert_eq!(config.scale("transformer_blocks.0.attn.to_k", 4), 2.0);
        assert_eq!(config.scale("transformer_blocks.0.attn.to_q", 4), 0.5);
        // A pattern matches whole dotted parts only.
        assert_eq!(config.scale("transformer_blocks.0.attn.add_to_q", 4), 2.0);
    }

    #[test]
    fn bare_keys_rslora_and_absent_settings() {
        let config =
            PeftConfig::from_metadata(&metadata(r#"{"lora_alpha": 8, "use_rslora": true}"#))
                .unwrap()
                .unwrap();
        assert_eq!(config.scale("proj_out", 16), 2.0);
        assert_eq!(PeftConfig::from_metadata(&BTreeMap::new()), Ok(None));
        assert_eq!(
            PeftConfig::from_metadata(&metadata(r#"{"format": "pt"}"#)),
            Ok(None)
        );
    }

    #[test]
    fn dora_and_malformed_settings_are_refused() {
        let dora = PeftConfig::from_metadata(&metadata(
            r#"{"transformer.lora_alpha": 8, "transformer.use_dora": true}"#,
        ));
        assert!(dora.unwrap_err().contains("DoRA"));
        let negative = PeftConfig::from_metadata(&metadata(r#"{"lora_alpha": -1}"#));
        assert!(negative.unwrap_err().contains("lora_alpha = -1"));
        assert!(PeftConfig::from_metadata(&metadata("[1")).is_err());
    }
}
