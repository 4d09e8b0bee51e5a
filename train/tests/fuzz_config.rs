//! Property-based fuzzing of the run-config loader: flux_tiny.toml with hostile `--set`
//! overrides (wrong types, zero, negative, huge, NaN, infinities, odd strings) and arbitrary
//! text. Loading never panics; a config that loads has a computable size and survives the
//! round trip through `config.toml` unchanged.

use flux_train::RunConfig;
use proptest::prelude::*;
use proptest::test_runner::Config;

fn cases() -> Config {
    Config {
        cases: 10_000,
        failure_persistence: None,
        ..Config::default()
    }
}

const BASE: &str = include_str!("../../configs/flux_tiny.toml");

/// Every key of a run config, as `--set` paths.
const KEYS: &[&str] = &[
    "model.num_joint_layers",
    "model.num_single_layers",
    "model.hidden_size",
    "model.num_attention_heads",
    "model.in_channels",
    "model.patch_size",
    "model.context_dim",
    "model.vec_in_dim",
    "model.model_channels",
    "model.mlp_ratio",
    "model.guidance_embed",
    "model.guidance_scale",
    "model.theta",
    "model.axes_dim",
    "model.layernorm_epsilon",
    "model.hidden_dropout",
    "model.attention_dropout",
    "parallelism.tensor_parallel_size",
    "parallelism.pipeline_parallel_size",
    "training.seed",
    "training.total_steps",
    "training.global_batch_size",
    "training.micro_batch_size",
    "training.latent_height",
    "training.latent_width",
    "training.text_len",
    "training.timestep_sampling",
    "training.cfg_dropout_prob",
    "training.loss",
    "training.precision",
    "training.recompute",
    "training.log_interval",
    "training.eval_interval",
    "training.eval_samples",
    "training.nonfinite",
    "optimization.learning_rate",
    "optimization.min_learning_rate",
    "optimization.weight_decay",
    "optimization.beta1",
    "optimization.beta2",
    "optimization.epsilon",
    "optimization.gradient_clip",
    "optimization.lr_schedule",
    "optimization.warmup_steps",
    "data.source",
    "data.paths",
    "data.prefetch",
    "checkpoint.interval",
    "checkpoint.keep",
    "checkpoint.format",
    "slurm.nodes",
    "slurm.ntasks_per_node",
    "slurm.time",
    "slurm.job_name",
    "model",
    "nonsense.key",
];

/// TOML values of every kind, biased to the edges.
fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        prop_oneof![
            Just(0i64),
            Just(1),
            Just(2),
            Just(3),
            Just(4),
            Just(8),
            Just(64),
            Just(-1),
            Just(i64::MAX),
            Just(i64::MIN),
            Just(1 << 40),
            Just(u32::MAX as i64),
        ]
        .prop_map(|v| v.to_string()),
        prop_oneof![
            Just("0.0"),
            Just("0.5"),
            Just("1.0"),
            Just("-1.0"),
            Just("nan"),
            Just("inf"),
            Just("-inf"),
            Just("1e308"),
            Just("5e-324"),
        ]
        .prop_map(str::to_string),
        prop_oneof![
            Just("\"\""),
            Just("\"hdf5\""),
            Just("\"skip\""),
            Just("\"bf16\""),
            Just("\"cosine\""),
            Just("\"a\\nb\""),
            Just("bare word"),
            Just("true"),
            Just("[]"),
            Just("[4, 6, 6]"),
            Just("[0, 0, 0]"),
            Just("[-2, 4, 6]"),
            Just("{ kind = \"mse\" }"),
            Just("{ strategy = \"uniform\" }"),
            Just("{ strategy = \"logit_normal\", mean = nan, std = -1.0 }"),
            Just("{ kind = \"huber\", delta = -1.0 }"),
        ]
        .prop_map(str::to_string),
    ]
}

fn overrides() -> impl Strategy<Value = Vec<String>> {
    proptest::collection::vec(
        (proptest::sample::select(KEYS), value()).prop_map(|(k, v)| format!("{k}={v}")),
        0..5,
    )
}

fn check_loaded(text: &str, overrides: &[String]) -> Result<(), TestCaseError> {
    let Ok(run) = RunConfig::parse(text, "fuzz.toml", overrides) else {
        return Ok(());
    };
    // What `flux-hpc info` and the trainer compute from any loaded config.
    let _ = run.model.num_params();
    let _ = run.model.param_specs(run.parallelism.tensor_parallel_size);
    let saved = toml::to_string(&run).expect("a loaded config serialises");
    let again = RunConfig::parse(&saved, "config.toml", &[]);
    prop_assert!(again.is_ok(), "{:?}\n{}", again.err(), saved);
    prop_assert_eq!(again.unwrap(), run);
    Ok(())
}

#[test]
fn hostile_overrides_never_panic_and_loaded_configs_round_trip() {
    proptest!(cases(), |(sets in overrides())| {
        check_loaded(BASE, &sets)?;
    });
}

#[test]
fn arbitrary_text_never_panics() {
    let line = prop_oneof![
        Just("[model]".to_string()),
        Just("[training]".to_string()),
        Just("[[model]]".to_string()),
        (proptest::sample::select(KEYS), value()).prop_map(|(k, v)| {
            let key = k.rsplit('.').next().unwrap_or(k);
            format!("{key} = {v}")
        }),
        "[ -~]{0,24}",
    ];
    proptest!(cases(), |(lines in proptest::collection::vec(line, 0..12))| {
        check_loaded(&lines.join("\n"), &[])?;
    });
}
