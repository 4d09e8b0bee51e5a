//! Property-based fuzzing of every reader of untrusted bytes: `.npy` files, safetensors headers,
//! latent shards and checkpoints with hostile shapes and attributes. Each property runs 10,000
//! generated cases; the property is that reading returns (an error or a value), never panics.

use std::path::{Path, PathBuf};

use flux_data::checkpoint::{self, Reader};
use flux_data::convert::SafetensorsReader;
use flux_data::dataset::{validate_shard, LatentDataset};
use flux_data::ingest::parse_npy;
use hdf5::types::VarLenUnicode;
use proptest::prelude::*;
use proptest::test_runner::Config;

fn cases() -> Config {
    Config {
        cases: 10_000,
        failure_persistence: None,
        ..Config::default()
    }
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("flux-fuzz-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Sizes a hostile writer would pick: zero, small, boundary and huge values.
fn size() -> impl Strategy<Value = i64> {
    prop_oneof![
        4 => 0i64..6,
        1 => Just(-1i64),
        1 => Just(i64::MAX),
        1 => Just(1i64 << 40),
        1 => Just(1i64 << 24),
    ]
}

fn sizes(max: usize) -> impl Strategy<Value = Vec<i64>> {
    proptest::collection::vec(size(), 0..max)
}

fn npy_header() -> impl Strategy<Value = String> {
    let descr = prop_oneof![
        Just("<f4"),
        Just("<f2"),
        Just("<u2"),
        Just(">f4"),
        Just("<f8"),
        Just("|b1"),
        Just("")
    ];
    let shape = proptest::collection::vec(
        prop_oneof![
            Just("0"),
            Just("3"),
            Just("-1"),
            Just("99999999999999999999"),
            Just("x")
        ],
        0..4,
    );
    (descr, any::<bool>(), shape, any::<bool>()).prop_map(|(d, fortran, shape, comma)| {
        let sep = if comma { ", " } else { "," };
        format!(
            "{{'descr': '{d}', 'fortran_order': {}, 'shape': ({}{}), }}",
            if fortran { "True" } else { "False" },
            shape.join(sep),
            if shape.len() == 1 { "," } else { "" }
        )
    })
}

fn npy_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..64),
        (
            npy_header(),
            any::<u8>(),
            any::<u16>(),
            proptest::collection::vec(any::<u8>(), 0..48)
        )
            .prop_map(|(header, major, declared, body)| {
                let mut out = b"\x93NUMPY".to_vec();
                out.push(major % 4);
                out.push(0);
                let len = if declared % 3 == 0 {
                    declared
                } else {
                    header.len() as u16
                };
                out.extend(len.to_le_bytes());
                out.extend(header.as_bytes());
                out.extend(body);
                out
            }),
    ]
}

#[test]
fn npy_parser_never_panics() {
    proptest!(cases(), |(bytes in npy_bytes())| {
        if let Ok(array) = parse_npy(&bytes) {
            let n: usize = array.shape.iter().product();
            prop_assert_eq!(n, array.values.len());
        }
    });
}

fn safetensors_entry() -> impl Strategy<Value = String> {
    let dtype = prop_oneof![Just("F32"), Just("BF16"), Just("F64"), Just("I8"), Just("")];
    let number = prop_oneof![
        0u64..16,
        Just(u64::MAX),
        Just(1u64 << 62),
        Just(u32::MAX as u64)
    ];
    (
        dtype,
        proptest::collection::vec(number.clone(), 0..4),
        proptest::collection::vec(number, 0..3),
        any::<bool>(),
    )
        .prop_map(|(dtype, shape, offsets, negative)| {
            let list = |v: &[u64]| {
                v.iter()
                    .map(|n| n.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            };
            let shape = if negative {
                "[-1]".to_string()
            } else {
                format!("[{}]", list(&shape))
            };
            format!(
                r#"{{"dtype":"{dtype}","shape":{shape},"data_offsets":[{}]}}"#,
                list(&offsets)
            )
        })
}

fn safetensors_file() -> impl Strategy<Value = Vec<u8>> {
    (
        proptest::collection::vec(safetensors_entry(), 0..4),
        prop_oneof![Just(None), any::<u64>().prop_map(Some)],
        proptest::collection::vec(any::<u8>(), 0..64),
        any::<bool>(),
    )
        .prop_map(|(entries, declared, data, garbage)| {
            let header = if garbage {
                String::from_utf8_lossy(&data).into_owned()
            } else {
                let fields: Vec<String> = entries
                    .iter()
                    .enumerate()
                    .map(|(i, e)| format!(r#""t{i}":{e}"#))
                    .collect();
                format!("{{{}}}", fields.join(","))
            };
            let len = declared.unwrap_or(header.len() as u64);
            let mut out = len.to_le_bytes().to_vec();
            out.extend(header.as_bytes());
            out.extend(&data);
            out
        })
}

#[test]
fn safetensors_reader_never_panics() {
    let dir = scratch("safetensors");
    let path = dir.join("case.safetensors");
    proptest!(cases(), |(bytes in safetensors_file())| {
        std::fs::write(&path, &bytes).unwrap();
        if let Ok(reader) = SafetensorsReader::open(&path) {
            for name in reader.tensors().keys() {
                let _ = reader.read_f32(name);
            }
        }
    });
    std::fs::remove_dir_all(dir).unwrap();
}

/// Attributes and datasets of a latent shard, each possibly hostile.
#[derive(Debug, Clone)]
struct ShardCase {
    version: u64,
    dtype: &'static str,
    latent_shape: Vec<i64>,
    text_shape: Vec<i64>,
    pooled: u64,
    num_samples: u64,
    scale_shift: Vec<f64>,
    /// Rows and per-row shape of `latents`, `t5`, `clip`.
    datasets: Vec<(usize, Vec<usize>)>,
    ids: usize,
}

fn shard_case() -> impl Strategy<Value = ShardCase> {
    let dims = |n: usize| proptest::collection::vec(0usize..4, n..=n);
    (
        (
            prop_oneof![Just(1u64), Just(2), 0u64..4],
            prop_oneof![Just("bf16"), Just("f32"), Just("f16"), Just("int8")],
            sizes(5),
            sizes(4),
            prop_oneof![0u64..5, Just(u64::MAX)],
        ),
        (
            prop_oneof![0u64..5, Just(u64::MAX)],
            proptest::collection::vec(
                prop_oneof![Just(1.0), Just(0.0), Just(f64::NAN), Just(-3.5)],
                0..4,
            ),
            (0usize..4, dims(3)),
            (0usize..4, dims(2)),
            (0usize..4, dims(1)),
            0usize..4,
        ),
    )
        .prop_map(
            |(
                (version, dtype, latent_shape, text_shape, pooled),
                (num_samples, ss, l, t, c, ids),
            )| {
                ShardCase {
                    version,
                    dtype,
                    latent_shape,
                    text_shape,
                    pooled,
                    num_samples,
                    scale_shift: ss,
                    datasets: vec![l, t, c],
                    ids,
                }
            },
        )
}

fn write_shard(path: &Path, case: &ShardCase) -> hdf5::Result<()> {
    let file = hdf5::File::create(path)?;
    let u64_attr = |name: &str, v: u64| file.new_attr::<u64>().create(name)?.write_scalar(&v);
    let str_attr = |name: &str, v: &str| {
        let v: VarLenUnicode = v.parse().unwrap();
        file.new_attr::<VarLenUnicode>()
            .create(name)?
            .write_scalar(&v)
    };
    u64_attr("format_version", case.version)?;
    str_attr("dtype", case.dtype)?;
    for (name, values) in [
        ("latent_shape", &case.latent_shape),
        ("text_shape", &case.text_shape),
    ] {
        file.new_attr::<i64>()
            .shape([values.len()])
            .create(name)?
            .write_raw(values)?;
    }
    u64_attr("pooled_dim", case.pooled)?;
    u64_attr("has_logvar", 0)?;
    u64_attr("has_captions", 0)?;
    u64_attr("num_samples", case.num_samples)?;
    file.new_attr::<f64>()
        .shape([case.scale_shift.len()])
        .create("latent_scale_shift")?
        .write_raw(&case.scale_shift)?;
    for key in ["vae_encoder", "text_encoder", "pooled_encoder"] {
        str_attr(key, "fuzz")?;
    }
    for (name, (rows, shape)) in ["latents", "t5", "clip"].iter().zip(&case.datasets) {
        let dims: Vec<usize> = std::iter::once(*rows).chain(shape.clone()).collect();
        let n: usize = dims.iter().product();
        let ds = file.new_dataset::<u16>().shape(dims).create(*name)?;
        ds.write_raw(&vec![0x3f80u16; n])?;
        ds.new_attr::<u64>().create("crc32")?.write_scalar(&0u64)?;
    }
    let ids: Vec<VarLenUnicode> = (0..case.ids)
        .map(|i| i.to_string().parse().unwrap())
        .collect();
    let ds = file
        .new_dataset::<VarLenUnicode>()
        .shape([case.ids])
        .create("ids")?;
    ds.write_raw(&ids)?;
    ds.new_attr::<u64>().create("crc32")?.write_scalar(&0u64)?;
    Ok(())
}

#[test]
fn latent_shard_readers_never_panic_on_hostile_attributes() {
    let dir = scratch("shards");
    let path = dir.join("case.h5");
    proptest!(cases(), |(case in shard_case())| {
        write_shard(&path, &case).unwrap();
        if let Ok(data) = LatentDataset::open(std::slice::from_ref(&path)) {
            for i in 0..data.len().min(3) + 1 {
                let _ = data.read(i);
            }
        }
        let _ = validate_shard(&path);
    });
    std::fs::remove_dir_all(dir).unwrap();
}

/// One checkpoint file's attributes and its one parameter dataset, each possibly hostile.
#[derive(Debug, Clone)]
struct CheckpointCase {
    version: u64,
    tp_size: u64,
    tp_rank: u64,
    stored: Vec<usize>,
    logical: Vec<i64>,
    split: Vec<i64>,
    parts: Vec<i64>,
    names: String,
    files: usize,
    /// Root attributes `dp_rank` (0) and `dp_size` of a file of data-parallel parts.
    dp_size: Option<u64>,
    /// No field was made hostile: the checkpoint must load.
    pristine: bool,
}

/// A consistent checkpoint of one tensor: `tp` files, a logical shape of rank 1–3, replicated
/// or split (plainly or in named parts) on one dimension.
fn valid_checkpoint() -> impl Strategy<Value = CheckpointCase> {
    (
        1usize..3,
        proptest::collection::vec(1i64..4, 1..4),
        proptest::option::of(0usize..3),
        proptest::collection::vec(1i64..3, 0..3),
    )
        .prop_map(|(tp, mut logical, split, part_units)| {
            let split = split.map(|d| d % logical.len());
            let mut parts = Vec::new();
            if let Some(d) = split {
                if part_units.is_empty() {
                    logical[d] *= tp as i64;
                } else {
                    parts = part_units.iter().map(|u| u * tp as i64).collect();
                    logical[d] = parts.iter().sum();
                }
            }
            let mut stored: Vec<usize> = logical.iter().map(|&d| d as usize).collect();
            if let Some(d) = split {
                stored[d] /= tp;
            }
            CheckpointCase {
                version: 2,
                tp_size: tp as u64,
                tp_rank: 0,
                stored,
                logical,
                split: vec![split.map_or(-1, |d| d as i64)],
                names: (0..parts.len())
                    .map(|i| format!("p{i}"))
                    .collect::<Vec<_>>()
                    .join(","),
                parts,
                files: tp,
                dp_size: None,
                pristine: true,
            }
        })
}

/// A consistent checkpoint with at most one field made hostile.
fn checkpoint_case() -> impl Strategy<Value = CheckpointCase> {
    (valid_checkpoint(), 0usize..11, sizes(4), any::<u64>()).prop_map(
        |(mut case, field, hostile, word)| {
            let small = word % 5;
            case.pristine = field >= 10;
            match field {
                0 => case.version = small,
                1 => case.tp_size = [0, 1, 2, 3, u64::MAX][small as usize],
                2 => case.tp_rank = [1, u64::MAX, 2, 3, 7][small as usize],
                3 => case.stored = hostile.iter().map(|&d| (d.clamp(0, 5)) as usize).collect(),
                4 => case.logical = hostile,
                5 => case.split = hostile,
                6 => case.parts = hostile,
                7 => case.names = [",", "", "a", "a,b,c", "p0"][small as usize].to_string(),
                8 => case.files = 1 + small as usize % 3,
                9 => case.dp_size = Some([0, 2, 3, u64::MAX, 1 << 40][small as usize]),
                _ => {}
            }
            case
        },
    )
}

fn write_checkpoint_file(path: &Path, case: &CheckpointCase, rank: u64) -> hdf5::Result<()> {
    let file = hdf5::File::create(path)?;
    let u64_attr = |loc: &hdf5::Location, name: &str, v: u64| {
        loc.new_attr::<u64>().create(name)?.write_scalar(&v)
    };
    let str_attr = |loc: &hdf5::Location, name: &str, v: &str| {
        let v: VarLenUnicode = v.parse().unwrap();
        loc.new_attr::<VarLenUnicode>()
            .create(name)?
            .write_scalar(&v)
    };
    let i64s_attr = |loc: &hdf5::Location, name: &str, v: &[i64]| {
        loc.new_attr::<i64>()
            .shape([v.len()])
            .create(name)?
            .write_raw(v)
    };
    u64_attr(&file, "format_version", case.version)?;
    for name in ["step", "optimizer_step", "data_epoch", "data_index"] {
        u64_attr(&file, name, 1)?;
    }
    u64_attr(&file, "tp_size", case.tp_size)?;
    u64_attr(&file, "tp_rank", case.tp_rank.wrapping_add(rank))?;
    if let Some(dp_size) = case.dp_size {
        u64_attr(&file, "dp_rank", 0)?;
        u64_attr(&file, "dp_size", dp_size)?;
    }
    str_attr(&file, "config", "")?;
    let group = file.create_group("params")?;
    let n: usize = case.stored.iter().product();
    let values = vec![0.5f32; n];
    let ds = group
        .new_dataset::<f32>()
        .shape(case.stored.clone())
        .create("w")?;
    ds.write_raw(&values)?;
    u64_attr(&ds, "crc32", checkpoint::crc32_f32(&values) as u64)?;
    i64s_attr(&ds, "logical_shape", &case.logical)?;
    i64s_attr(&ds, "split_dim", &case.split)?;
    i64s_attr(&ds, "part_sizes", &case.parts)?;
    str_attr(&ds, "part_names", &case.names)?;
    str_attr(&ds, "dtype", "Float")
}

#[test]
fn checkpoint_reader_never_panics_on_hostile_shapes_and_attributes() {
    let dir = scratch("checkpoints");
    proptest!(cases(), |(case in checkpoint_case())| {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for rank in 0..case.files {
            write_checkpoint_file(&dir.join(format!("tp_{rank:02}.h5")), &case, rank as u64)
                .unwrap();
        }
        match checkpoint::load(&dir) {
            Ok(loaded) => {
                let w = &loaded.tensors["params"]["w"];
                prop_assert_eq!(w.size(), case.logical.clone());
                prop_assert!(bool::try_from(w.eq(0.5).all()).unwrap());
            }
            Err(e) => prop_assert!(!case.pristine, "a consistent checkpoint failed: {}", e),
        }
        let _ = Reader::open(&dir).and_then(|r| r.describe());
    });
    std::fs::remove_dir_all(dir).unwrap();
}
