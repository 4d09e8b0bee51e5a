//! Latent shards on disk: round trips in every storage type, epoch shuffling and the
//! data-parallel split, the prefetch thread, and detection of corrupt, truncated and mis-shaped
//! shards.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use flux_data::dataset::{
    validate, BatchPlan, DataPosition, LatentDataset, Prefetcher, Sample, SampleOrder, ShardLayout,
    ShardWriter, StorageDtype,
};
use flux_data::{DataError, VaeNorm};

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("flux-dataset-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn layout(dtype: StorageDtype, logvar: bool, captions: bool) -> ShardLayout {
    ShardLayout {
        latent: [4, 3, 2],
        text: [5, 6],
        pooled: 7,
        dtype,
        logvar,
        captions,
        mask: false,
        norm: VaeNorm::FLUX1,
        encoders: ["ae".into(), "t5-v1_1-xxl".into(), "clip-vit-l-14".into()],
    }
}

/// Sample `i`: values that bf16 holds exactly (small integers over 8), distinct per sample.
fn sample(i: usize, layout: &ShardLayout) -> Sample {
    let values = |n: usize, offset: usize| -> Vec<f32> {
        (0..n)
            .map(|k| ((i * 31 + k * 7 + offset) % 97) as f32 / 8.0 - 6.0)
            .collect()
    };
    let [c, h, w] = layout.latent;
    Sample {
        id: format!("sample-{i:04}"),
        latents: values(c * h * w, 0),
        logvar: layout.logvar.then(|| values(c * h * w, 1)),
        t5: values(layout.text[0] * layout.text[1], 2),
        clip: values(layout.pooled, 3),
        caption: layout.captions.then(|| format!("a photo of thing {i}")),
        // Weights in [0, 1] that bf16 holds exactly.
        mask: layout
            .mask
            .then(|| (0..h * w).map(|k| ((i + k) % 5) as f32 / 4.0).collect()),
    }
}

fn write(path: &Path, layout: &ShardLayout, range: std::ops::Range<usize>, deflate: Option<u8>) {
    let mut w = ShardWriter::create(path, layout, deflate).unwrap();
    for i in range {
        w.append(&sample(i, layout)).unwrap();
    }
    w.finish().unwrap();
}

#[test]
fn shards_round_trip_in_every_storage_type() {
    let dir = temp("roundtrip");
    for (dtype, deflate) in [
        (StorageDtype::Bf16, None),
        (StorageDtype::F16, Some(4)),
        (StorageDtype::F32, Some(1)),
    ] {
        let layout = layout(dtype, true, true);
        let path = dir.join(format!("{dtype}.h5"));
        write(&path, &layout, 0..5, deflate);
        assert!(!path.with_extension("h5.tmp").exists());
        let data = LatentDataset::open(std::slice::from_ref(&path)).unwrap();
        assert_eq!(data.len(), 5);
        assert_eq!(data.layout(), &layout);
        for i in 0..5 {
            assert_eq!(
                data.read(i as u64).unwrap(),
                sample(i, &layout),
                "{dtype} sample {i}"
            );
        }
        let report = validate(&[path]).unwrap();
        assert!(report.problems.is_empty(), "{:?}", report.problems);
        assert_eq!(report.samples(), 5);
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_sample_of_the_wrong_size_is_refused_naming_the_field() {
    let dir = temp("wrong-size");
    let layout = layout(StorageDtype::Bf16, false, false);
    let mut w = ShardWriter::create(&dir.join("a.h5"), &layout, None).unwrap();
    let mut bad = sample(0, &layout);
    bad.t5.pop();
    let err = w.append(&bad).unwrap_err().to_string();
    assert!(err.contains("`t5` has 29 values"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn loss_masks_round_trip_and_leave_0_to_1() {
    let dir = temp("mask");
    let layout = ShardLayout {
        mask: true,
        ..layout(StorageDtype::Bf16, true, false)
    };
    let path = dir.join("masked.h5");
    write(&path, &layout, 0..3, None);
    let data = LatentDataset::open(std::slice::from_ref(&path)).unwrap();
    assert!(data.layout().mask);
    for i in 0..3 {
        assert_eq!(data.read(i as u64).unwrap(), sample(i, &layout));
    }
    assert!(validate(&[path]).unwrap().problems.is_empty());

    let mut w = ShardWriter::create(&dir.join("bad.h5"), &layout, None).unwrap();
    let mut bad = sample(0, &layout);
    bad.mask.as_mut().unwrap()[2] = 1.5;
    let err = w.append(&bad).unwrap_err().to_string();
    assert!(err.contains("sample-0000") && err.contains("1.5"), "{err}");
    bad.mask = None;
    let err = w.append(&bad).unwrap_err().to_string();
    assert!(err.contains("loss-mask presence"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn shards_of_several_buckets_form_one_dataset_read_a_bucket_per_step() {
    let dir = temp("buckets");
    let wide = layout(StorageDtype::F32, false, false);
    let tall = ShardLayout {
        latent: [4, 4, 2],
        ..wide.clone()
    };
    write(&dir.join("a.h5"), &wide, 0..5, None);
    write(&dir.join("b.h5"), &tall, 5..12, None);
    write(&dir.join("c.h5"), &wide, 12..15, None);
    let data = LatentDataset::open(std::slice::from_ref(&dir)).unwrap();
    let buckets = data.buckets();
    assert_eq!(
        buckets.keys().copied().collect::<Vec<_>>(),
        [[3, 2], [4, 2]]
    );
    assert_eq!(buckets[&[3, 2]], [0, 1, 2, 3, 4, 12, 13, 14]);
    assert_eq!(data.layout_of(6), &tall);
    assert!(validate(std::slice::from_ref(&dir))
        .unwrap()
        .problems
        .is_empty());

    // Steps of 4 over 2 ranks × 1 micro-batch of 2: every micro-batch, on either rank, is one
    // bucket, and its layout says which.
    let order = SampleOrder::bucketed(9, buckets.into_values().collect(), 4, true);
    assert_eq!(order.len(), 8 + 4);
    for rank in 0..2 {
        let plan = BatchPlan {
            next_step_start: 0,
            global: 4,
            micro: 2,
            rank,
            replicas: 2,
        };
        let data = LatentDataset::open(std::slice::from_ref(&dir)).unwrap();
        let mut prefetcher = Prefetcher::spawn(data, order.clone(), plan.micro_batches(), 2);
        for _ in 0..6 {
            let fetched = prefetcher.next_batch().unwrap();
            let [c, h, w] = fetched.layout.latent;
            assert!(fetched.samples.iter().all(|s| s.latents.len() == c * h * w));
        }
    }

    // Other text shapes are not a bucket: refused naming the shard.
    let other = ShardLayout {
        text: [4, 6],
        ..wide.clone()
    };
    write(&dir.join("d.h5"), &other, 0..2, None);
    let err = LatentDataset::open(std::slice::from_ref(&dir))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("d.h5") && err.contains("more than the latent size"),
        "{err}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn epochs_are_seeded_permutations_split_disjointly_across_ranks() {
    let len = 23;
    let p0 = SampleOrder::permutation(5, len, 0);
    let p1 = SampleOrder::permutation(5, len, 1);
    assert_eq!(
        p0.iter().copied().collect::<BTreeSet<_>>().len(),
        len as usize
    );
    assert_ne!(p0, p1, "each epoch has its own order");
    assert_eq!(p0, SampleOrder::permutation(5, len, 0), "seeded");
    assert_ne!(p0, SampleOrder::permutation(6, len, 0));

    // Three steps of 8 samples over 2 ranks × 2 micro-batches of 2: the ranks' counters are
    // disjoint and together cover every counter once.
    let plans: Vec<Vec<Vec<u64>>> = (0..2)
        .map(|rank| {
            let plan = BatchPlan {
                next_step_start: 0,
                global: 8,
                micro: 2,
                rank,
                replicas: 2,
            };
            plan.micro_batches().take(3 * 2).collect()
        })
        .collect();
    let all: Vec<u64> = plans.iter().flatten().flatten().copied().collect();
    assert_eq!(
        all.iter().copied().collect::<BTreeSet<_>>(),
        (0..24).collect()
    );
    assert_eq!(plans[0][0], vec![0, 1]);
    assert_eq!(plans[1][0], vec![2, 3]);
    assert_eq!(plans[0][1], vec![4, 5]);

    // Counter 30 of 23 samples is epoch 1, index 7, and visits epoch 1's 8th sample.
    let position = DataPosition::of(30, len);
    assert_eq!(position, DataPosition { epoch: 1, index: 7 });
    assert_eq!(position.counter(len), 30);
    let mut order = SampleOrder::new(5, len, true);
    assert_eq!(order.index(30), p1[7]);
    assert_eq!(SampleOrder::new(5, len, false).index(30), 7);
}

#[test]
fn the_prefetcher_delivers_the_planned_batches_in_order() {
    let dir = temp("prefetch");
    let layout = layout(StorageDtype::Bf16, false, false);
    write(&dir.join("part_0.h5"), &layout, 0..7, None);
    write(&dir.join("part_1.h5"), &layout, 7..12, None);
    let data = LatentDataset::open(std::slice::from_ref(&dir)).unwrap();
    assert_eq!(data.len(), 12);
    let plan = BatchPlan {
        next_step_start: 8,
        global: 4,
        micro: 2,
        rank: 1,
        replicas: 2,
    };
    let expected: Vec<Vec<u64>> = plan.micro_batches().take(5).collect();
    let mut prefetcher =
        Prefetcher::spawn(data, SampleOrder::new(3, 12, true), plan.micro_batches(), 2);
    let direct = LatentDataset::open(std::slice::from_ref(&dir)).unwrap();
    let mut order = SampleOrder::new(3, 12, true);
    for counters in expected {
        let fetched = prefetcher.next_batch().unwrap();
        assert_eq!(fetched.counters, counters);
        for (c, s) in counters.iter().zip(&fetched.samples) {
            assert_eq!(*s, direct.read(order.index(*c)).unwrap());
        }
    }
    drop(prefetcher);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_flipped_byte_is_reported_by_validate_naming_file_and_dataset() {
    let dir = temp("flip");
    let layout = layout(StorageDtype::F32, false, false);
    let path = dir.join("shard.h5");
    let mut w = ShardWriter::create(&path, &layout, None).unwrap();
    let mut s = sample(0, &layout);
    s.clip[3] = 1234.5;
    w.append(&s).unwrap();
    w.finish().unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    let needle = 1234.5f32.to_le_bytes();
    let at = bytes
        .windows(4)
        .position(|w| w == needle)
        .expect("value stored raw");
    bytes[at + 1] ^= 0x10;
    std::fs::write(&path, &bytes).unwrap();
    let report = validate(std::slice::from_ref(&path)).unwrap();
    match report.problems.as_slice() {
        [DataError::Corrupt { path: p, dataset }] => {
            assert!(p.ends_with("shard.h5"));
            assert_eq!(dataset, "clip");
        }
        other => panic!("expected one CRC error, got {other:?}"),
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// Overwrite a shard's `text_shape` attribute.
fn set_text_shape(path: &Path, shape: [i64; 2]) {
    let f = hdf5::File::open_rw(path).unwrap();
    f.delete_attr("text_shape").unwrap();
    f.new_attr::<i64>()
        .shape([2])
        .create("text_shape")
        .unwrap()
        .write_raw(&shape)
        .unwrap();
}

#[test]
fn truncated_and_mis_shaped_shards_are_errors_naming_the_file() {
    let dir = temp("broken");
    let layout = layout(StorageDtype::Bf16, false, false);
    let good = dir.join("a_good.h5");
    write(&good, &layout, 0..4, None);

    let truncated = dir.join("b_truncated.h5");
    let bytes = std::fs::read(&good).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() * 2 / 3]).unwrap();
    let err = LatentDataset::open(std::slice::from_ref(&dir))
        .err()
        .expect("truncated shard refused");
    assert!(err.to_string().contains("b_truncated.h5"), "{err}");
    std::fs::remove_file(&truncated).unwrap();

    // An attribute that disagrees with the dataset's shape.
    let misshaped = dir.join("c_misshaped.h5");
    std::fs::copy(&good, &misshaped).unwrap();
    set_text_shape(&misshaped, [5, 8]);
    let err = LatentDataset::open(std::slice::from_ref(&dir))
        .err()
        .expect("mis-shaped shard refused");
    let text = err.to_string();
    assert!(
        text.contains("c_misshaped.h5") && text.contains("`t5`"),
        "{text}"
    );

    // A hostile shape attribute is an error, not an allocation.
    set_text_shape(&misshaped, [-1, 1 << 40]);
    let err = LatentDataset::open(&[misshaped]).err().unwrap().to_string();
    assert!(err.contains("text_shape"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_shard_named_twice_or_a_special_file_is_refused() {
    let dir = temp("twice");
    let layout = layout(StorageDtype::Bf16, false, false);
    let shard = dir.join("a.h5");
    write(&shard, &layout, 0..2, None);
    for paths in [
        vec![shard.clone(), shard.clone()],
        vec![dir.clone(), shard.clone()],
    ] {
        let err = LatentDataset::open(&paths)
            .err()
            .expect("a shard read twice");
        assert!(err.to_string().contains("is listed twice"), "{err}");
    }
    // A named pipe among the shards is refused, not opened (which would block).
    let fifo = dir.join("b.h5");
    common::mkfifo(&fifo);
    for paths in [vec![dir.clone()], vec![fifo.clone()]] {
        let err = LatentDataset::open(&paths).err().expect("a FIFO opened");
        assert!(err.to_string().contains("b.h5: is a FIFO"), "{err}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}
