//! HDF5 checkpoints on disk: atomic publication, pruning, resharding and corruption detection.

use std::path::PathBuf;

use flux_data::checkpoint::{self, CheckpointLayout, TrainingState};
use flux_data::DataError;
use flux_model::tp::{parts, LinearDecl, LinearInit, ParamSpec, Shard, SingleRank, TpContext};
use tch::{Device, Kind, Tensor};

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("flux-ckpt-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A fused column-parallel weight and its bias.
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
        data: flux_data::dataset::DataPosition {
            epoch: 1,
            index: step,
        },
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
    assert_eq!(
        loaded.data,
        flux_data::dataset::DataPosition { epoch: 1, index: 9 }
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
        Err(DataError::Corrupt { path, dataset }) => {
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
