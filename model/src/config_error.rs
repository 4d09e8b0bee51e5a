//! `ConfigError`: a config value that breaks a rule, named by its dotted field.

/// A config value that breaks a rule; `field` is the dotted key as written in TOML.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct ConfigError {
    /// The offending key, e.g. `model.num_attention_heads`.
    pub field: String,
    /// What is wrong and what would be accepted.
    pub message: String,
}

impl ConfigError {
    /// An error for `field` (prefixed with its table by the caller via [`ConfigError::within`]).
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }

    /// `Ok` when `ok`, else an error for `field` with the message `message` makes.
    pub fn check(ok: bool, field: &str, message: impl FnOnce() -> String) -> Result<(), Self> {
        if ok {
            Ok(())
        } else {
            Err(Self::new(field, message()))
        }
    }

    /// The same error with `table.` prepended to the field name.
    pub fn within(self, table: &str) -> Self {
        Self {
            field: if self.field.is_empty() {
                table.to_string()
            } else {
                format!("{table}.{}", self.field)
            },
            ..self
        }
    }
}
