//! Where a run starts: the checkpoint it resumes from, or a fresh start that is only allowed
//! where it cannot silently discard an earlier run's checkpoints.
//!
//! - `resume = true`: the checkpoint `latest` names; when that fails to load, or `latest` itself
//!   is missing or malformed, the newest checkpoint that loads on every rank (a warning for each
//!   passed over). A directory whose checkpoints all fail is an error, never a fresh start.
//! - `resume = false` in a directory that holds checkpoints: refused, unless the user forces a
//!   new start, which deletes the old run's checkpoints first (listed in a warning).

use std::path::Path;

use flux_data::checkpoint::{self, LoadedCheckpoint};
use flux_data::DataError;
use flux_model::tp::Collective;

/// How a run treats the checkpoints already in its directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StartPolicy {
    /// `[checkpoint] resume`.
    pub resume: bool,
    /// Start over even though the directory holds checkpoints (`flux-hpc train --force`).
    pub force: bool,
}

/// The checkpoint the run continues from (`None`: a fresh start), decided collectively over
/// `world` so every rank starts from the same step. Errors are the same on every rank.
pub fn starting_checkpoint(
    dir: &Path,
    policy: StartPolicy,
    world: &dyn Collective,
) -> Result<Option<LoadedCheckpoint>, DataError> {
    if policy.resume {
        return newest_usable_checkpoint(dir, world);
    }
    let existing = checkpoint::list(dir)?;
    if existing.is_empty() && !dir.join("latest").exists() {
        return Ok(None);
    }
    if !policy.force {
        let newest = existing
            .last()
            .map_or("a `latest` pointer".to_string(), |c| {
                format!("newest {}", c.display())
            });
        return Err(DataError::format(
            dir,
            format!(
                "holds {} checkpoint(s) ({newest}) of an earlier run and [checkpoint] resume = \
                 false: set resume = true to continue it, choose another [checkpoint] dir, or \
                 pass --force to delete them and start over",
                existing.len()
            ),
        ));
    }
    // Every rank sees the directory before rank 0 empties it.
    world.count_failures(false);
    let removed = match world.rank() {
        0 => checkpoint::remove_all(dir),
        _ => Ok(Vec::new()),
    };
    let failed = world.count_failures(removed.is_err());
    let removed = removed?;
    if failed > 0 {
        return Err(DataError::format(
            dir,
            "rank 0 could not remove the earlier run's checkpoints",
        ));
    }
    for path in &removed {
        tracing::warn!("--force: removed {}", path.display());
    }
    Ok(None)
}

/// The checkpoint to resume from: the one `latest` names, or, when it fails to load (a truncated
/// file, a checksum mismatch) or `latest` is unusable, the newest older one that loads, with a
/// warning for each passed over. `None` only for a directory without checkpoints.
fn newest_usable_checkpoint(
    dir: &Path,
    world: &dyn Collective,
) -> Result<Option<LoadedCheckpoint>, DataError> {
    let latest = checkpoint::latest(dir).unwrap_or_else(|e| {
        tracing::warn!("{e}; trying every checkpoint of {}", dir.display());
        None
    });
    let mut candidates = checkpoint::list(dir)?;
    if let Some(latest) = &latest {
        candidates.retain(|c| c <= latest);
    }
    let mut passed_over = 0;
    for candidate in candidates.iter().rev() {
        let loaded = checkpoint::load(candidate);
        if let Err(e) = &loaded {
            tracing::warn!("checkpoint {} is unusable: {e}", candidate.display());
        }
        if world.count_failures(loaded.is_err()) == 0 {
            if passed_over > 0 && world.rank() == 0 {
                tracing::warn!(
                    "falling back to {} ({passed_over} newer checkpoint(s) unusable)",
                    candidate.display()
                );
            }
            return Ok(loaded.ok());
        }
        passed_over += 1;
    }
    match passed_over {
        0 => Ok(None),
        n => Err(DataError::format(
            dir,
            format!(
                "none of its {n} checkpoint(s) loads on every rank (see the warnings); move them \
                 away, or pass --force with [checkpoint] resume = false to start over"
            ),
        )),
    }
}

/// The architecture a checkpoint's stored run config names (`"flux"` for configs from before
/// architectures were named, whose `[model]` table has no `architecture` key).
pub(crate) fn stored_architecture(config: &str) -> Result<String, String> {
    let table: toml::Table = config
        .parse()
        .map_err(|e| format!("its stored run config is not valid TOML: {e}"))?;
    match table
        .get("model")
        .and_then(|m| m.get(flux_model::architecture::ARCHITECTURE_KEY))
    {
        None => Ok(flux_model::ARCHITECTURES[0].name.to_string()),
        Some(toml::Value::String(name)) => Ok(name.clone()),
        Some(other) => Err(format!(
            "its stored run config names the architecture {other}, not a string"
        )),
    }
}

/// Refuse a checkpoint written by another architecture than `expected`, naming both.
pub fn check_architecture(checkpoint: &LoadedCheckpoint, expected: &str) -> Result<(), String> {
    let dir = checkpoint.dir.display();
    let stored = stored_architecture(&checkpoint.config).map_err(|e| format!("{dir}: {e}"))?;
    if stored == expected {
        return Ok(());
    }
    Err(format!(
        "{dir} holds a \"{stored}\" model, but this run's [model] architecture is \"{expected}\"; \
         resume it with a config of architecture \"{stored}\", or start this run in another \
         [checkpoint] dir"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_architectures_default_to_flux() {
        assert_eq!(
            stored_architecture("[model]\nhidden_size = 8").unwrap(),
            "flux"
        );
        assert_eq!(stored_architecture("").unwrap(), "flux");
        let dit = "[model]\narchitecture = \"dit\"\ndepth = 2";
        assert_eq!(stored_architecture(dit).unwrap(), "dit");
        assert!(stored_architecture("[model]\narchitecture = 3").is_err());
        assert!(stored_architecture("[model").is_err());
    }
}
