//! HDF5 checkpoints on disk: atomic publication, pruning, resharding and corruption detection.

mod common;

use std::path::{Path, PathBuf};

use common::mkfifo;
use flux_data::checkpoint::{
    self, CheckpointLayout, CheckpointWriter, OptimizerState, TrainingState,
};
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
    let (exp_avg, exp_avg_sq) = (zeros(), zeros());
    TrainingState {
        step,
        config: "[model]\n".into(),
        run_id: "test-run".into(),
        data: flux_data::dataset::DataPosition {
            epoch: 1,
            index: step,
        },
        optimizer: OptimizerState {
            step,
            params: tensors,
            exp_avg,
            exp_avg_sq,
            ema: None,
            parts: None,
        },
    }
}

/// A one-process sharded checkpoint writer into `dir` keeping `keep`.
fn writer<'a>(dir: &'a Path, tp: &'a TpContext, keep: usize) -> CheckpointWriter<'a> {
    CheckpointWriter {
        run_dir: dir,
        layout: CheckpointLayout::Sharded,
        keep,
        tp,
        dp_rank: 0,
        world: &SingleRank,
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
        writer(&dir, &tp, 2)
            .save(
                &state(step, vec![&w * step as f64, b.shallow_clone()]),
                &specs,
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
    let saved = writer(&dir, &tp, 1)
        .save(
            &state(1, vec![w, Tensor::zeros([8], (Kind::Float, Device::Cpu))]),
            &specs,
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
    // `ckpt inspect` sees what resuming would reject, in a moment group too, named with its group.
    let inspected = checkpoint::inspect(&saved).expect_err("inspect finds it");
    assert!(
        matches!(&inspected, DataError::Corrupt { dataset, .. } if dataset == "exp_avg/layer.weight"),
        "{inspected}"
    );
    match checkpoint::load(&saved) {
        Err(DataError::Corrupt { path, dataset }) => {
            assert!(path.ends_with("tp_00.h5"));
            assert_eq!(dataset, "exp_avg/layer.weight");
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
    // Malformed pointers are errors too, never "no checkpoint" (which would start the run over).
    std::fs::create_dir_all(dir.join("step_000000001")).unwrap();
    let abs = dir.join("step_000000001").display().to_string();
    for text in [
        "",
        "  \n",
        abs.as_str(),
        "../step_000000001",
        "step_000000001/",
        ".",
    ] {
        std::fs::write(dir.join("latest"), text).unwrap();
        let err = checkpoint::latest(&dir).expect_err(text).to_string();
        assert!(
            err.contains("not the name of a checkpoint directory"),
            "{text:?}: {err}"
        );
    }
    // Nor may a special file stall it, or stand in for a checkpoint file.
    std::fs::remove_file(dir.join("latest")).unwrap();
    mkfifo(&dir.join("latest"));
    let err = checkpoint::latest(&dir).unwrap_err().to_string();
    assert!(err.contains("FIFO"), "{err}");
    mkfifo(&dir.join("step_000000001/tp_00.h5"));
    let err = checkpoint::load(&dir.join("step_000000001"))
        .err()
        .expect("a FIFO loaded")
        .to_string();
    assert!(err.contains("tp_00.h5: is a FIFO"), "{err}");
    assert!(checkpoint::latest(&temp("empty")).unwrap().is_none());
    std::fs::remove_dir_all(dir).unwrap();
}

/// Write `weight`'s flattened elements split at `cuts` as data-parallel parts, one file each.
fn write_parts(
    dir: &Path,
    spec: &ParamSpec,
    weight: &Tensor,
    cuts: &[(usize, usize)],
) -> Vec<PathBuf> {
    let flat = weight.flatten(0, -1);
    cuts.iter()
        .enumerate()
        .map(|(dp, &(start, end))| {
            let path = dir.join(checkpoint::part_file_name(0, dp));
            let file = hdf5::File::create(&path).unwrap();
            let group = file.create_group("params").unwrap();
            let part = flat.slice(0, start as i64, end as i64, 1);
            checkpoint::write_part(&group, spec, &weight.size(), start, &part, &path).unwrap();
            path
        })
        .collect()
}

#[test]
fn data_parallel_parts_reassemble_and_a_gap_is_refused() {
    let dir = temp("parts");
    let spec = &specs(1)[0];
    let weight = Tensor::randn([8, 3], (Kind::Float, Device::Cpu));
    let read = |paths: &[PathBuf]| {
        let files: Vec<hdf5::File> = paths.iter().map(|p| hdf5::File::open(p).unwrap()).collect();
        let pairs: Vec<(&Path, &hdf5::File)> =
            paths.iter().map(PathBuf::as_path).zip(&files).collect();
        checkpoint::read_tensor(&pairs, "params", &spec.name, 1)
    };

    // Parts written in any order, one of them empty (a rank owning none of a small tensor).
    let paths = write_parts(&dir, spec, &weight, &[(10, 24), (0, 10), (24, 24)]);
    let (read_back, read_spec) = read(&paths).unwrap();
    assert!(read_back.equal(&weight));
    // The layout is stored; how gradients are synchronised is not.
    let layout = |s: &ParamSpec| (s.shape.clone(), s.split_dim, s.parts.clone());
    assert_eq!(layout(&read_spec), layout(spec));

    // Elements 10..12 held by no part.
    let paths = write_parts(&dir, spec, &weight, &[(0, 10), (12, 24)]);
    let err = read(&paths).unwrap_err().to_string();
    assert!(err.contains("does not continue"), "{err}");

    // The last elements held by no part.
    let paths = write_parts(&dir, spec, &weight, &[(0, 10), (10, 20)]);
    let err = read(&paths).unwrap_err().to_string();
    assert!(
        err.contains("parts hold 20 of the shard's 24 elements"),
        "{err}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// The checkpoint of `step` by run `run_id` written as data-parallel part `dp` of 2 into
/// `run_dir` (each part is half of every tensor's elements), as one rank of a sharded optimizer
/// writes it; returns the part file.
fn write_half(run_dir: &Path, step: u64, run_id: &str, dp: usize, weight: &Tensor) -> PathBuf {
    let specs = specs(1);
    let bias = Tensor::arange(8, (Kind::Float, Device::Cpu));
    let halves = [weight.flatten(0, -1), bias];
    let (offsets, parts): (Vec<usize>, Vec<Tensor>) = halves
        .iter()
        .map(|t| {
            let half = t.numel() / 2;
            (dp * half, t.narrow(0, (dp * half) as i64, half as i64))
        })
        .unzip();
    let mut state = state(step, parts);
    state.run_id = run_id.into();
    state.optimizer.parts = Some(checkpoint::DpParts {
        dp_rank: dp,
        dp_size: 2,
        offsets,
        local_shapes: vec![vec![8, 3], vec![8]],
        writes: true,
    });
    let tp = TpContext::single();
    let dir = writer(run_dir, &tp, 5).save(&state, &specs).unwrap();
    dir.join(checkpoint::part_file_name(0, dp))
}

#[test]
fn parts_of_another_run_or_step_are_refused_naming_them() {
    let dir = temp("belonging");
    let weight = Tensor::randn([8, 3], (Kind::Float, Device::Cpu));
    let half = |name: &str, step: u64, run: &str, dp: usize| {
        write_half(&dir.join(name), step, run, dp, &weight)
    };
    let (a0, a1) = (half("a0", 2, "run-a", 0), half("a1", 2, "run-a", 1));
    // The same layout written by another run, and by this run at another step.
    let (b1, e1) = (half("b1", 2, "run-b", 1), half("e1", 1, "run-a", 1));
    // A checkpoint directory `step` of the run directory `name` holding copies of `parts`.
    let assemble = |name: &str, step: &str, parts: [&PathBuf; 2]| {
        let step_dir = dir.join(name).join(step);
        std::fs::create_dir_all(&step_dir).unwrap();
        for part in parts {
            std::fs::copy(part, step_dir.join(part.file_name().unwrap())).unwrap();
        }
        step_dir
    };
    let whole = assemble("whole", "step_000000002", [&a0, &a1]);
    let loaded = checkpoint::load(&whole).unwrap();
    assert_eq!(loaded.run_id, "run-a");
    assert!(loaded.tensors["params"]["layer.weight"].equal(&weight));
    for (name, stray, why) in [
        (
            "other-run",
            &b1,
            "written by run run-b, the other by run run-a",
        ),
        ("other-step", &e1, "it holds step 1"),
    ] {
        let mixed = assemble(name, "step_000000002", [&a0, stray]);
        let err = checkpoint::load(&mixed).err().unwrap().to_string();
        assert!(
            err.contains("tp_00_dp_001.h5") && err.contains(why),
            "{why}: {err}"
        );
        assert!(checkpoint::inspect(&mixed).is_err());
    }
    // A whole checkpoint copied under another step's name.
    let renamed = assemble("renamed", "step_000000007", [&a0, &a1]);
    let err = checkpoint::load(&renamed).err().unwrap().to_string();
    assert!(
        err.contains("holds step 2 but lies in the checkpoint of step 7"),
        "{err}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}
