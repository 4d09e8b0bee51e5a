//! Run-config files: the shipped presets load, bad input names the offending field.

use std::path::{Path, PathBuf};

use flux_model::dit::DitConfig;
use flux_model::{FluxConfig, ModelSpec};
use flux_train::{RunConfig, RunConfigError};

fn config_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../configs")
        .join(name)
}

/// The error of `text` (given a `[model]` table when it has none, as a config must) with
/// `overrides`.
fn parse_err(text: &str, overrides: &[&str]) -> String {
    let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    let text = match text.contains("[model") {
        true => text.to_string(),
        // Appended, so the lines errors name stay those of `text`.
        false => format!("{text}\n[model]\nhidden_size = 3072\n"),
    };
    RunConfig::parse(&text, "test.toml", &overrides)
        .unwrap_err()
        .to_string()
}

#[test]
fn an_empty_config_or_model_table_is_an_error_not_the_12b_defaults() {
    for text in ["", "[training]\ntotal_steps = 3\n", "[model]\n"] {
        let err = RunConfig::parse(text, "test.toml", &[])
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("test.toml: model: the ")
                && err.contains("configs/flux_12b.toml spells"),
            "{text:?}: {err}"
        );
    }
    let err = parse_err("[checkpoint]\ndir = \"\"\n", &[]);
    assert!(err.contains("checkpoint.dir: is empty"), "{err}");
    let err = parse_err("[data]\nsource = \"hdf5\"\npaths = [\"a\", \"\"]\n", &[]);
    assert!(err.contains("data.paths: an entry is empty"), "{err}");
    let err = parse_err("[training]\nmax_consecutive_skips = 0\n", &[]);
    assert!(err.contains("training.max_consecutive_skips"), "{err}");
    let err = parse_err("[parallelism]\ncollective_timeout_s = 0\n", &[]);
    assert!(err.contains("parallelism.collective_timeout_s"), "{err}");
}

#[test]
fn shipped_configs_load_and_match_the_presets() {
    let c535 = RunConfig::load(&config_path("flux_535m.toml"), &[]).unwrap();
    assert_eq!(c535.model, ModelSpec::new(FluxConfig::flux_535m()));
    assert_eq!(c535.model.num_params(), 535_318_336);
    let c12 = RunConfig::load(&config_path("flux_12b.toml"), &[]).unwrap();
    assert_eq!(
        c12.model,
        ModelSpec::new(FluxConfig {
            guidance_embed: true,
            ..FluxConfig::flux_12b()
        })
    );
    assert_eq!(c12.parallelism.tensor_parallel_size, 8);
    let tiny = RunConfig::load(&config_path("flux_tiny.toml"), &[]).unwrap();
    assert!(tiny.model.num_params() < 1_000_000);
}

#[test]
fn unknown_keys_are_rejected_with_their_name() {
    let err = parse_err("[model]\nhiden_size = 64\n", &[]);
    assert!(
        err.starts_with("test.toml:")
            && err.contains("model.hiden_size: not a key of architecture \"flux\""),
        "{err}"
    );
    let err = parse_err("[modle]\n", &[]);
    assert!(err.contains("unknown field `modle`"), "{err}");
}

#[test]
fn the_architecture_key_selects_the_model_and_foreign_keys_are_named() {
    let dit = RunConfig::load(&config_path("dit_tiny.toml"), &[]).unwrap();
    assert_eq!(dit.model.architecture(), "dit");
    assert_eq!(dit.model.get::<DitConfig>().unwrap().depth, 4);
    assert!(dit.model.inputs().text_dim.is_none());
    // Saved and read back (what checkpoints store), the architecture is kept.
    let again = RunConfig::parse(&toml::to_string(&dit).unwrap(), "saved.toml", &[]).unwrap();
    assert_eq!(again, dit);

    let err = parse_err("[model]\narchitecture = \"sd3\"\n", &[]);
    assert!(
        err.starts_with("test.toml:")
            && err.contains("model.architecture: unknown architecture \"sd3\"")
            && err.contains("\"dit\""),
        "{err}"
    );
    // A Flux key under architecture = "dit", and a DiT key in a (default) Flux table.
    let err = parse_err(
        "[model]\narchitecture = \"dit\"\nnum_joint_layers = 2\n",
        &[],
    );
    assert!(
        err.contains("model.num_joint_layers: not a key of architecture \"dit\""),
        "{err}"
    );
    let err = parse_err("[model]\ndepth = 2\n", &[]);
    assert!(
        err.contains("model.depth: not a key of architecture \"flux\""),
        "{err}"
    );
    // An override switches the architecture like the file would.
    let run = RunConfig::parse(
        "[model]\nhidden_size = 64\n",
        "test.toml",
        &["model.architecture=dit".into()],
    )
    .unwrap();
    assert_eq!(run.model.get::<DitConfig>().unwrap().hidden_size, 64);
}

#[test]
fn wrong_types_name_the_key() {
    let err = parse_err("[model]\nhidden_size = \"wide\"\n", &[]);
    assert!(
        err.contains("hidden_size") && err.contains("invalid type"),
        "{err}"
    );
}

#[test]
fn invalid_values_name_table_and_field() {
    let err = parse_err("[model]\nnum_attention_heads = 5\n", &[]);
    assert_eq!(
        err,
        "test.toml: model.num_attention_heads: 5 heads do not divide hidden_size 3072"
    );
    let err = parse_err("[model]\naxes_dim = [16, 56]\n", &[]);
    assert!(
        err.starts_with("test.toml: model.axes_dim: needs exactly 3 entries"),
        "{err}"
    );
}

#[test]
fn pipeline_parallelism_is_rejected() {
    let err = parse_err("[parallelism]\npipeline_parallel_size = 2\n", &[]);
    assert!(
        err.starts_with(
            "test.toml: parallelism.pipeline_parallel_size: pipeline parallelism is not supported"
        ),
        "{err}"
    );
}

#[test]
fn tensor_parallel_size_must_divide_heads() {
    let err = parse_err("[parallelism]\ntensor_parallel_size = 5\n", &[]);
    assert!(
        err.contains("parallelism.tensor_parallel_size: 5 must divide num_attention_heads (24)"),
        "{err}"
    );
}

#[test]
fn overrides_are_applied_and_checked_like_the_file() {
    let set = |items: &[&str]| items.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let config = RunConfig::parse(
        "[model]\n",
        "t",
        &set(&[
            "model.num_attention_heads=4",
            "model.hidden_size=512",
            "model.guidance_embed=true",
        ]),
    )
    .unwrap();
    let flux = config.model.get::<FluxConfig>().unwrap();
    assert_eq!((flux.hidden_size, flux.num_attention_heads), (512, 4));
    assert!(flux.guidance_embed);

    let err = parse_err("[model]\n", &["model.hidden_size=513"]);
    assert!(
        err.contains("model.num_attention_heads: 24 heads do not divide hidden_size 513"),
        "{err}"
    );
    let err = parse_err("[model]\n", &["model.widht=3"]);
    assert!(
        err.starts_with("test.toml: model.widht: not a key of architecture \"flux\""),
        "{err}"
    );
    let err = parse_err("[model]\n", &["hidden_size"]);
    assert_eq!(err, "--set hidden_size: expected KEY=VALUE");
    let err = parse_err("[model]\nhidden_size = 64\n", &["model.hidden_size.x=1"]);
    assert!(err.contains("`hidden_size` is not a table"), "{err}");
}

#[test]
fn missing_files_name_the_path() {
    let err = RunConfig::load(Path::new("/nonexistent/run.toml"), &[]).unwrap_err();
    assert!(matches!(err, RunConfigError::Read { .. }));
    assert!(
        err.to_string().starts_with("/nonexistent/run.toml: "),
        "{err}"
    );
}

#[test]
fn parse_errors_show_the_line() {
    let err = parse_err("[model]\nhidden_size = 64\nhiden_size = 64\n", &[]);
    assert!(
        err.starts_with("test.toml: line 3, column 1: model.hiden_size: not a key"),
        "{err}"
    );
    let err = parse_err("[training]\nseed = 1\nsede = 2\n", &[]);
    assert!(err.contains("line 3"), "{err}");
}

#[test]
fn training_sections_are_validated_with_their_field_names() {
    let err = parse_err(
        "[training]\nglobal_batch_size = 6\nmicro_batch_size = 4\n",
        &[],
    );
    assert!(
        err.contains(
            "training.global_batch_size: 6 is not a positive multiple of micro_batch_size 4"
        ),
        "{err}"
    );
    let err = parse_err("[optimization]\nbeta2 = 1.5\n", &[]);
    assert!(
        err.contains("optimization.beta2: must be in [0, 1), got 1.5"),
        "{err}"
    );
    let err = parse_err("[optimization]\noptimizer = \"sgd\"\n", &[]);
    assert!(
        err.contains("optimization.optimizer: only \"adamw\" is supported"),
        "{err}"
    );
    let err = parse_err("[data]\nsource = \"hdf5\"\n", &[]);
    assert!(
        err.contains("data.paths: source = \"hdf5\" needs at least one shard"),
        "{err}"
    );
    let err = parse_err("[data]\nsource = \"webdataset\"\n", &[]);
    assert!(
        err.contains("line 2") && err.contains("unknown variant `webdataset`"),
        "{err}"
    );
    let err = parse_err(
        "[parallelism]\nsharding = \"optimizer\"\noverlap_grad_reduce = true\n",
        &[],
    );
    assert!(
        err.contains("parallelism.overlap_grad_reduce: overlaps plain data parallelism"),
        "{err}"
    );
    let err = parse_err("[parallelism]\nshard_group_size = 2\n", &[]);
    assert!(
        err.contains("parallelism.shard_group_size: groups the replicas that shard state"),
        "{err}"
    );
    let err = parse_err(
        "[parallelism]\nsharding = \"gradients\"\nshard_group_size = 1\n",
        &[],
    );
    assert!(
        err.contains("parallelism.shard_group_size: a group of one replica shards nothing"),
        "{err}"
    );
    let err = parse_err("[data]\nbuckets = [\"64x48\", \"64x48\"]\n", &[]);
    assert!(err.contains("data.buckets: 64x48 is listed twice"), "{err}");
    let err = parse_err("[data]\nbuckets = [\"64*48\"]\n", &[]);
    assert!(err.contains("not WIDTHxHEIGHT"), "{err}");
    let err = parse_err("[sampling]\ninterval = 10\nprompts = [\"a cat\"]\n", &[]);
    assert!(
        err.contains("sampling.encoders: sampling needs a FLUX.1 folder"),
        "{err}"
    );
    let err = parse_err("[logging]\ntensorboard = \"yes\"\n", &[]);
    assert!(err.contains("invalid type"), "{err}");
    let err = parse_err("[checkpoint]\nkeep = 0\n", &[]);
    assert!(
        err.contains("checkpoint.keep: must keep at least 1 checkpoint"),
        "{err}"
    );
    let err = parse_err(
        "[model]\nhidden_dropout = 0.1\n[training]\nrecompute = true\n",
        &[],
    );
    assert!(
        err.contains(
            "training.recompute: recomputation replays layers without their dropout masks"
        ),
        "{err}"
    );
    let err = parse_err(
        "[training]\ntimestep_sampling = { strategy = \"cosine\" }\n",
        &[],
    );
    assert!(err.contains("unknown variant `cosine`"), "{err}");
}

#[test]
fn sequence_parallelism_is_refused_where_it_cannot_apply() {
    let err = parse_err("[parallelism]\nsequence_parallel = true\n", &[]);
    assert!(
        err.contains(
            "parallelism.sequence_parallel: splits the sequence over the tensor-parallel group"
        ),
        "{err}"
    );
    let tiny = std::fs::read_to_string(config_path("flux_tiny.toml")).unwrap();
    let sp = [
        "parallelism.tensor_parallel_size=2",
        "parallelism.sequence_parallel=true",
    ];
    let with = |extra: &'static str| [&sp[..], &[extra]].concat();
    let err = parse_err(&tiny, &with("model.hidden_dropout=0.1"));
    assert!(
        err.contains("parallelism.sequence_parallel: needs model.hidden_dropout = 0 (got 0.1)"),
        "{err}"
    );
    let err = parse_err(&tiny, &with("training.text_len=7"));
    assert!(
        err.contains("training.text_len: 7 text tokens do not split over tensor_parallel_size 2"),
        "{err}"
    );
    let odd = ["training.latent_height=5", "training.latent_width=5"];
    let err = parse_err(&tiny, &[&sp[..], &odd].concat());
    assert!(
        err.contains("training.latent_height: 25 image tokens do not split"),
        "{err}"
    );
    // flux_tiny's 64 image and 8 text tokens split over 2 ranks.
    RunConfig::parse(&tiny, "flux_tiny.toml", &sp.map(String::from)).unwrap();
}

#[test]
fn the_fp8_table_needs_fp8_precision_and_names_a_bad_recipe() {
    use flux_model::float8::Float8Recipe;
    let text = std::fs::read_to_string(config_path("flux_tiny.toml")).unwrap();
    let load = |overrides: &[&str]| {
        let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        RunConfig::parse(&text, "flux_tiny.toml", &overrides)
    };
    // Without the table, fp8 precision takes torchao's default recipe and the layer stacks.
    let run = load(&["training.precision=\"fp8\""]).unwrap();
    let settings = run.float8().unwrap();
    assert_eq!(settings.recipe, Float8Recipe::Tensorwise);
    assert!(settings.targets.is_empty());
    let run = load(&["training.precision=\"fp8\"", "fp8.recipe=\"rowwise_gw_hp\""]).unwrap();
    assert_eq!(run.float8().unwrap().recipe, Float8Recipe::RowwiseGwHp);
    assert!(load(&["training.precision=\"bf16\""])
        .unwrap()
        .float8()
        .is_none());

    let err = load(&["fp8.recipe=\"rowwise\""]).unwrap_err().to_string();
    assert!(
        err.contains("fp8") && err.contains("precision = \"fp8\""),
        "{err}"
    );
    let err = parse_err(
        &text,
        &["training.precision=\"fp8\"", "fp8.recipe=\"delayed\""],
    );
    assert!(
        err.contains("delayed") && err.contains("tensorwise"),
        "{err}"
    );
}
