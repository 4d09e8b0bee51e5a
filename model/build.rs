//! Build the custom autograd nodes (csrc/: tensor-parallel regions, activation recomputation)
//! against the libtorch torch-sys links, and embed libtorch's folder in the rpath of this crate's
//! tests.

use std::path::PathBuf;

fn main() {
    flux_build::link_libtorch_rpath();
    let lib = PathBuf::from(
        std::env::var("DEP_TCH_LIBTORCH_LIB").expect("torch-sys exports its lib dir"),
    );
    let root = lib.parent().expect("libtorch lib folder has a parent");
    println!("cargo:rerun-if-changed=csrc/tp_regions.cpp");
    println!("cargo:rerun-if-changed=csrc/recompute.cpp");
    cc::Build::new()
        .cpp(true)
        .file("csrc/tp_regions.cpp")
        .file("csrc/recompute.cpp")
        .include(root.join("include"))
        .include(root.join("include/torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag("-D_GLIBCXX_USE_CXX11_ABI=1")
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .warnings(false)
        .compile("flux_autograd_nodes");
}
