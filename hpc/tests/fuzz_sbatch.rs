//! Property-based fuzzing of the batch-script renderer with hostile `[slurm]` values, overrides
//! and paths: rendering never panics, every value it accepts comes back from the shell exactly as
//! given, and a sample of the scripts it writes parse as bash.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use flux_cluster::slurm::{quote, render, JobSpec, Launcher, SlurmConfig};
use proptest::prelude::*;
use proptest::test_runner::Config;

/// Strings a hostile config would hold: shell metacharacters, quotes, expansions, tabs,
/// non-ASCII, and now and then a newline, carriage return or NUL (which must be refused).
fn hostile() -> impl Strategy<Value = String> {
    let piece = |line_breaks: bool| {
        let safe = prop_oneof![
            Just("a"),
            Just(" "),
            Just("'"),
            Just("\""),
            Just("$(touch /tmp/pwned)"),
            Just("`id`"),
            Just("${HOME}"),
            Just(";"),
            Just("&&"),
            Just("|"),
            Just("\\"),
            Just("\t"),
            Just("#"),
            Just("*"),
            Just("~"),
            Just("é"),
            Just("--x=1"),
            Just("=")
        ];
        let breaks = prop_oneof![Just("\n"), Just("\r"), Just("\0")];
        if line_breaks {
            prop_oneof![8 => safe, 1 => breaks].boxed()
        } else {
            safe.boxed()
        }
    };
    prop_oneof![
        9 => proptest::collection::vec(piece(false), 1..6),
        1 => proptest::collection::vec(piece(true), 0..6),
    ]
    .prop_map(|p| p.concat())
}

/// A valid environment variable name, or now and then a hostile one.
fn env_key() -> impl Strategy<Value = String> {
    prop_oneof![9 => "[A-Z_][A-Z0-9_]{0,8}", 1 => hostile()]
}

fn option() -> impl Strategy<Value = Option<String>> {
    proptest::option::of(hostile())
}

fn slurm() -> impl Strategy<Value = SlurmConfig> {
    (
        (hostile(), option(), option(), option(), option()),
        (
            prop_oneof![9 => 1u32..4, 1 => Just(0u32)],
            prop_oneof![9 => 1u32..9, 1 => Just(u32::MAX)],
            0u32..3,
        ),
        (option(), option(), option(), any::<bool>(), option()),
        (
            prop_oneof![9 => Just("01:00:00".to_string()), 1 => hostile()],
            prop_oneof![9 => Just("USR1".to_string()), 1 => hostile()],
            proptest::collection::vec((env_key(), hostile()), 0..3),
            proptest::collection::vec(hostile(), 0..3),
            option(),
            prop_oneof![
                Just(Launcher::SrunPmix),
                Just(Launcher::SrunPmi2),
                Just(Launcher::Mpirun)
            ],
        ),
    )
        .prop_map(|(names, counts, more, rest)| {
            let (job_name, partition, account, qos, mem) = names;
            let (nodes, ntasks_per_node, gpus_per_node) = counts;
            let (output, constraint, dependency, exclusive, mail_user) = more;
            let (time, signal, env, modules, container_image, launcher) = rest;
            SlurmConfig {
                job_name,
                partition,
                account,
                qos,
                mem,
                nodes,
                ntasks_per_node,
                gpus_per_node,
                output,
                constraint,
                dependency,
                exclusive,
                mail_user,
                time,
                signal,
                env: env.into_iter().collect::<BTreeMap<_, _>>(),
                modules,
                container_image,
                launcher,
                ..SlurmConfig::default()
            }
        })
}

fn cases(n: u32) -> Config {
    Config {
        cases: n,
        failure_persistence: None,
        ..Config::default()
    }
}

/// Render `slurm` with hostile overrides and paths; `None` when validation or rendering refused.
fn rendered(slurm: &SlurmConfig, overrides: &[String], dir: &str) -> Option<String> {
    slurm.validate().ok()?;
    let config = Path::new(dir).join("run.toml");
    let job = JobSpec {
        slurm,
        config: &config,
        overrides,
        run_dir: Path::new(dir),
        workdir: Path::new(dir),
        binary: "/opt/flux-hpc/bin/flux-hpc",
        array_tasks: &[],
        origin: dir,
    };
    render(&job).ok()
}

#[test]
fn quoting_round_trips_through_the_shell_lexer() {
    proptest!(cases(10_000), |(value in hostile())| {
        match quote(&value, "value") {
            Ok(quoted) => prop_assert_eq!(shlex::split(&quoted), Some(vec![value])),
            Err(message) => prop_assert!(value.contains(['\n', '\r', '\0']), "{}", message),
        }
    });
}

#[test]
fn rendering_never_panics_on_hostile_values() {
    proptest!(cases(10_000), |(
        s in slurm(),
        overrides in proptest::collection::vec(hostile(), 0..3),
        dir in hostile(),
    )| {
        let _ = rendered(&s, &overrides, &format!("/runs/{dir}"));
    });
}

#[test]
fn rendered_scripts_parse_as_bash() {
    let parsed = std::cell::Cell::new(0);
    proptest!(cases(300), |(
        s in slurm(),
        overrides in proptest::collection::vec(hostile(), 0..3),
        dir in hostile(),
    )| {
        if let Some(script) = rendered(&s, &overrides, &format!("/runs/{dir}")) {
            let out = Command::new("bash").args(["-n", "-c", &script]).output().unwrap();
            prop_assert!(out.status.success(), "{}\n{}", script, String::from_utf8_lossy(&out.stderr));
            parsed.set(parsed.get() + 1);
        }
    });
    assert!(parsed.get() > 0, "no generated config was valid");
}
