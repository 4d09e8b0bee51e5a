//! The batch script of `configs/flux_12b.toml` against a checked-in copy (as submitit keeps a
//! golden sbatch file): any change to the rendering shows up in review. Regenerate with
//! `UPDATE_GOLDEN=1 cargo test -p flux-cluster --test sbatch_golden` after a deliberate change.

use std::path::Path;

use flux_cluster::slurm::{render, JobSpec, SlurmConfig};

#[derive(serde::Deserialize)]
struct OnlySlurm {
    slurm: SlurmConfig,
}

fn config() -> SlurmConfig {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../configs/flux_12b.toml"
    ))
    .unwrap();
    let table: toml::Table = text.parse().unwrap();
    let slurm = toml::Table::from_iter([("slurm".to_string(), table["slurm"].clone())]);
    toml::Value::Table(slurm)
        .try_into::<OnlySlurm>()
        .unwrap()
        .slurm
}

#[test]
fn flux_12b_renders_the_golden_script() {
    let slurm = config();
    slurm.validate().unwrap();
    let overrides = ["optimization.learning_rate=5e-5".to_string()];
    let job = JobSpec {
        slurm: &slurm,
        config: Path::new("/home/user/flux-hpc/configs/flux_12b.toml"),
        overrides: &overrides,
        run_dir: Path::new("/lustre/user/runs/flux_12b"),
        workdir: Path::new("/home/user/flux-hpc"),
        binary: "/home/user/flux-hpc/target/release/flux-hpc",
        array_tasks: &[],
        origin: "written by `flux-hpc sbatch configs/flux_12b.toml`",
    };
    let script = render(&job).unwrap();
    let golden = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/flux_12b.sbatch");
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&golden, &script).unwrap();
    }
    assert_eq!(script, std::fs::read_to_string(&golden).unwrap());
}
