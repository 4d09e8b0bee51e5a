//! Embed libtorch's folder in the rpath of this crate's tests, and build the c10d bridge
//! (csrc/c10d_groups.cpp): gloo always (its headers come from Debian's libgloo-dev), NCCL where
//! CUDA's and NCCL's headers sit beside the wheel's libtorch.

fn main() {
    flux_build::link_libtorch_rpath();
    let mut build = flux_build::libtorch_cpp(&["csrc/c10d_groups.cpp"]);
    if let Some(includes) = flux_build::cuda_includes() {
        build.includes(includes).define("FLUX_WITH_NCCL", None);
        println!("cargo:rustc-link-lib=c10_cuda");
    }
    build.compile("flux_c10d");
}
