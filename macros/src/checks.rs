//! Checks across the fields of one block, run on the fields that parsed; each returns every
//! error it finds, and says nothing a field that failed to parse could make wrong.

use syn::Error;

use crate::attrs::{BlockField, FieldKind, ShardKind};

/// Every cross-field error of `fields`; `failed` names the attributes of the fields that did
/// not parse (`"linear"`, …).
pub fn check(fields: &[BlockField], failed: &[String]) -> Vec<Error> {
    let mut errors = Vec::new();
    // A linear that failed to parse may be the column-parallel producer.
    if !failed.iter().any(|a| a == "linear") {
        errors.extend(row_has_column(fields));
    }
    errors
}

/// A row-parallel linear consumes a sharded input; within one block that shard must come from a
/// column-parallel linear. One error per row-parallel linear without one.
fn row_has_column(fields: &[BlockField]) -> Vec<Error> {
    let linears = fields.iter().filter_map(|f| match &f.kind {
        FieldKind::Linear(l) => Some(l),
        _ => None,
    });
    let (mut rows, mut has_column) = (Vec::new(), false);
    for l in linears {
        match l.shard {
            ShardKind::Row => rows.push(l.shard_span),
            ShardKind::Column => has_column = true,
            ShardKind::Replicated => {}
        }
    }
    if has_column {
        return Vec::new();
    }
    rows.into_iter()
        .map(|span| {
            Error::new(
                span,
                "row-parallel linear has no column-parallel producer in this block: its input would \
                 not be sharded. Add the `shard = column` linear that feeds it, or make this one \
                 `replicated`",
            )
        })
        .collect()
}
