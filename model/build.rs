//! Build the custom libtorch parts (csrc/: tensor-parallel regions, activation recomputation,
//! parameter residency, the counting CPU allocator, float8 linears) against the libtorch torch-sys links, and
//! embed libtorch's folder in the rpath of this crate's tests.

fn main() {
    flux_build::link_libtorch_rpath();
    println!("cargo:rerun-if-changed=csrc/guarded.h");
    flux_build::compile_libtorch_cpp(
        "flux_autograd_nodes",
        &[
            "csrc/tp_regions.cpp",
            "csrc/recompute.cpp",
            "csrc/residency.cpp",
            "csrc/tensor_memory.cpp",
            "csrc/fp8_linear.cpp",
        ],
    );
}
