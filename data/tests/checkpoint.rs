//! HDF5 checkpoints on disk: atomic publication, pruning, resharding and corruption detection.

use std::path::PathBuf;

use flux_data::checkpoint::{self, CheckpointError, CheckpointLayout, TrainingState};
use flux_model::tp::{parts, LinearDecl, LinearInit, ParamSpec, Shard, SingleRank, TpContext};
use tch::{Device, Kind, Tensor};

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("flux-ckpt-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A fused column-parallel weight at TP 2 and a replicated bias.
fn specs(tp: i64) -> Vec<ParamSpec> {
    LinearDecl {
        in_dim: 3,
        out_dim: 8,
        bias: true,
        shard: Shard::Column,
        parts: parts(&[("q", 4), ("mlp", 4)]),
        init: LinearInit::Xavier,
    }
    .param_specs("layer", tp)
}

fn state(step: u64, tensors: Vec<Tensor>) -> TrainingState {
    let zeros = || tensors.iter().map(Tensor::zeros_like).collect::<Vec<_>>();
    let (avg, avg_sq) = (zeros(), zeros());
    TrainingState {
        step,
        optimizer_step: step,
        config: "[model]\n".into(),
        groups: [tensors, avg, avg_sq],
    }
}

#[test]
fn a_single_rank_checkpoint_round_trips_and_publishes_latest() {
    let dir = temp("roundtrip");
    let specs = specs(1);
    let w = Tensor::randn([8, 3], (Kind::Float, Device::Cpu));
    let b = Tensor::randn([8], (Kind::Float, Device::Cpu));
    let tp = TpContext::single();
    for step in [3, 6, 9] {
        checkpoint::save(
            &dir,
            &state(step, vec![&w * step as f64, b.shallow_clone()]),
            &specs,
            CheckpointLayout::Sharded,
            &tp,
            0,
            &SingleRank,
            2,
        )
        .unwrap();
    }
    let latest = checkpoint::latest(&dir).unwrap().unwrap();
    assert!(latest.ends_with("step_000000009"));
    let kept: Vec<_> = checkpoint::list(&dir).unwrap();
    assert_eq!(kept.len(), 2, "keep = 2 prunes the oldest: {kept:?}");
    let loaded = checkpoint::load(&latest).unwrap();
    assert_eq!(
        (loaded.step, loaded.optimizer_step, loaded.config.as_str()),
        (9, 9, "[model]\n")
    );
    assert!(loaded.tensors["params"]["layer.weight"].equal(&(&w * 9.0)));
    assert!(loaded.tensors["exp_avg"]["layer.bias"].equal(&b.zeros_like()));
    let lines = checkpoint::inspect(&latest).unwrap();
    assert!(
        lines
            .iter()
            .any(|l| l.contains("layer.weight") && l.contains("split dim 0 in parts [q=4, mlp=4]")),
        "{lines:?}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn shards_written_at_tp2_reassemble_to_the_logical_tensor() {
    // Write the two TP-rank files of one checkpoint by hand (each rank's shard), then load.
    let dir = temp("reshard");
    let specs = specs(2);
    let full = Tensor::arange(24, (Kind::Float, Device::Cpu)).view([8, 3]);
    let bias = Tensor::arange(8, (Kind::Float, Device::Cpu));
    let step_dir = dir.join(checkpoint::step_dir_name(1));
    for rank in 0..2 {
        let tp = TpContext::new(Box::new(FakeRank(rank)));
        let local = vec![
            specs[0].shard_of(&full, rank),
            specs[1].shard_of(&bias, rank),
        ];
        let scratch = temp(&format!("scratch{rank}"));
        checkpoint::save(
            &scratch,
            &state(1, local),
            &specs,
            CheckpointLayout::Sharded,
            &tp,
            0,
            &SingleRank,
            1,
        )
        .unwrap();
        std::fs::create_dir_all(&step_dir).unwrap();
        let file = format!("tp_{rank:02}.h5");
        std::fs::copy(
            scratch.join("step_000000001").join(&file),
            step_dir.join(&file),
        )
        .unwrap();
        std::fs::remove_dir_all(scratch).unwrap();
    }
    let loaded = checkpoint::load(&step_dir).unwrap();
    assert!(loaded.tensors["params"]["layer.weight"].equal(&full));
    assert!(loaded.tensors["params"]["layer.bias"].equal(&bias));
    // A missing shard is reported, not papered over.
    std::fs::remove_file(step_dir.join("tp_01.h5")).unwrap();
    let err = checkpoint::load(&step_dir).err().unwrap();
    assert!(
        err.to_string()
            .contains("written at tensor-parallel size 2 but holds 1 file(s)"),
        "{err}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// Rank `r` of a group of two whose collectives are never called by `save` at layout Sharded
/// with a single-rank world.
struct FakeRank(usize);

impl flux_model::tp::Collective for FakeRank {
    fn rank(&self) -> usize {
        self.0
    }
    fn size(&self) -> usize {
        2
    }
    fn all_reduce_sum(&self, _: &mut [f32]) {
        unreachable!("sharded saves do not communicate within the TP group")
    }
    fn all_gather(&self, _: &[f32], _: &mut [f32]) {
        unreachable!("sharded saves do not communicate within the TP group")
    }
}

#[test]
fn a_changed_value_is_detected_by_its_checksum() {
    let dir = temp("corrupt");
    let specs = specs(1);
    let w = Tensor::randn([8, 3], (Kind::Float, Device::Cpu));
    let tp = TpContext::single();
    let saved = checkpoint::save(
        &dir,
        &state(1, vec![w, Tensor::zeros([8], (Kind::Float, Device::Cpu))]),
        &specs,
        CheckpointLayout::Sharded,
        &tp,
        0,
        &SingleRank,
        1,
    )
    .unwrap();
    let file = saved.join("tp_00.h5");
    {
        let f = hdf5::File::open_rw(&file).unwrap();
        let ds = f.group("exp_avg").unwrap().dataset("layer.weight").unwrap();
        let mut data = ds.read_raw::<f32>().unwrap();
        data[5] += 1.0;
        ds.write_raw(&data).unwrap();
    }
    match checkpoint::load(&saved) {
        Err(CheckpointError::Corrupt { path, dataset }) => {
            assert!(path.ends_with("tp_00.h5"));
            assert_eq!(dataset, "layer.weight");
        }
        Err(other) => panic!("expected a checksum error, got {other}"),
        Ok(_) => panic!("a corrupt checkpoint loaded"),
    }
    // A truncated file is an error naming it.
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() / 2]).unwrap();
    let err = checkpoint::load(&saved).err().unwrap();
    assert!(err.to_string().contains("tp_00.h5"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn latest_pointing_nowhere_is_an_error() {
    let dir = temp("dangling");
    std::fs::write(dir.join("latest"), "step_000000042\n").unwrap();
    let err = checkpoint::latest(&dir).unwrap_err();
    assert!(err.to_string().contains("does not exist"), "{err}");
    assert!(checkpoint::latest(&temp("empty")).unwrap().is_none());
    std::fs::remove_dir_all(dir).unwrap();
}
