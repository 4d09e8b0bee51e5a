//! Build the fused AdamW bridge (csrc/fused_adamw.cpp) against the libtorch torch-sys links, and
//! embed libtorch's folder in the rpath of this crate's tests.

fn main() {
    flux_build::link_libtorch_rpath();
    flux_build::compile_libtorch_cpp("flux_fused_adamw", &["csrc/fused_adamw.cpp"]);
}
