//! Build the fused AdamW bridge and the gradient-ready hook (csrc/) against the libtorch torch-sys links, and
//! embed libtorch's folder in the rpath of this crate's tests.

fn main() {
    flux_build::link_libtorch_rpath();
    flux_build::compile_libtorch_cpp(
        "flux_train_nodes",
        &["csrc/fused_adamw.cpp", "csrc/grad_ready.cpp"],
    );
}
