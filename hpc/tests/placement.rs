//! Placement from launcher variables, and device choice.

use std::collections::HashMap;

use flux_cluster::{DeviceChoice, DeviceError, Placement};
use tch::Device;

fn placement(vars: &[(&str, &str)]) -> Result<Placement, flux_cluster::PlacementError> {
    let map: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    Placement::from_vars(|name| map.get(name).cloned())
}

#[test]
fn no_launcher_means_a_single_process() {
    let p = placement(&[]).unwrap();
    assert_eq!(
        (p.rank, p.world_size, p.local_rank, p.local_size, p.source),
        (0, 1, 0, 1, "single")
    );
}

#[test]
fn openmpi_variables_win_over_slurm() {
    let p = placement(&[
        ("OMPI_COMM_WORLD_RANK", "3"),
        ("OMPI_COMM_WORLD_SIZE", "8"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "1"),
        ("SLURM_CPUS_PER_TASK", "7"),
    ])
    .unwrap();
    assert_eq!(
        (p.rank, p.world_size, p.local_rank, p.local_size),
        (3, 8, 1, 2)
    );
    assert_eq!(p.source, "openmpi");
    assert_eq!(p.threads(), 7);
}

#[test]
fn slurm_task_counts_per_node_are_understood() {
    let p = placement(&[
        ("SLURM_PROCID", "5"),
        ("SLURM_NTASKS", "6"),
        ("SLURM_LOCALID", "2"),
        ("SLURM_NTASKS_PER_NODE", "3(x2)"),
    ])
    .unwrap();
    assert_eq!(
        (p.rank, p.world_size, p.local_rank, p.local_size, p.source),
        (5, 6, 2, 3, "slurm")
    );
}

#[test]
fn malformed_variables_are_named() {
    let err = placement(&[("OMPI_COMM_WORLD_RANK", "two")]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "environment variable OMPI_COMM_WORLD_RANK=\"two\" is not a valid rank"
    );
    let err = placement(&[("PMI_RANK", "4"), ("PMI_SIZE", "4")]).unwrap_err();
    assert_eq!(err.name, "PMI_RANK");
}

#[test]
fn device_choice_parses_and_resolves() {
    assert_eq!("auto".parse::<DeviceChoice>().unwrap(), DeviceChoice::Auto);
    assert_eq!(
        "cuda:3".parse::<DeviceChoice>().unwrap(),
        DeviceChoice::Cuda(Some(3))
    );
    assert_eq!(
        "tpu".parse::<DeviceChoice>().unwrap_err(),
        DeviceError::Parse("tpu".into())
    );

    assert_eq!(DeviceChoice::Auto.resolve_with(3, 0).unwrap(), Device::Cpu);
    assert_eq!(
        DeviceChoice::Auto.resolve_with(5, 4).unwrap(),
        Device::Cuda(1)
    );
    assert_eq!(DeviceChoice::Cpu.resolve_with(0, 8).unwrap(), Device::Cpu);
    assert_eq!(
        DeviceChoice::Cuda(None).resolve_with(0, 0).unwrap_err(),
        DeviceError::NoCuda
    );
    assert_eq!(
        DeviceChoice::Cuda(Some(2)).resolve_with(0, 2).unwrap_err(),
        DeviceError::NoSuchGpu { index: 2, count: 2 }
    );
}

#[test]
fn auto_resolves_to_what_this_machine_has() {
    let device = DeviceChoice::Auto.resolve(0).unwrap();
    assert_eq!(device.is_cuda(), tch::Cuda::is_available());
}
