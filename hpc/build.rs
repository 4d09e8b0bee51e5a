//! Embed libtorch's folder in the rpath of this crate's tests, build the c10d bridge
//! (csrc/c10d_groups.cpp): gloo always (its headers come from Debian's libgloo-dev), NCCL where
//! CUDA's and NCCL's headers sit beside the wheel's libtorch; and the MPI constants rsmpi does
//! not export (csrc/mpi_constants.c), against the MPI that rsmpi itself finds.

fn main() {
    flux_build::link_libtorch_rpath();
    let mut build = flux_build::libtorch_cpp(&["csrc/c10d_groups.cpp"]);
    if let Some(includes) = flux_build::cuda_includes() {
        build.includes(includes).define("FLUX_WITH_NCCL", None);
        println!("cargo:rustc-link-lib=c10_cuda");
    }
    build.compile("flux_c10d");

    println!("cargo:rerun-if-changed=csrc/mpi_constants.c");
    let mpi = build_probe_mpi::probe().unwrap_or_else(|errors| {
        panic!("no MPI library found (as rsmpi looks for one): {errors:?}")
    });
    let mut constants = cc::Build::new();
    constants.file("csrc/mpi_constants.c");
    match mpi.mpicc {
        Some(mpicc) => constants.compiler(mpicc),
        None => constants.includes(mpi.include_paths),
    };
    constants.compile("flux_mpi_constants");
}
