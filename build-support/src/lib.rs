//! Build-script helpers shared by every crate whose binaries or tests link libtorch.
//!
//! torch-sys (`links = "tch"`) exports the folder holding `libtorch*.so` to the build scripts of crates
//! that depend on it directly, as `DEP_TCH_LIBTORCH_LIB`. Writing that folder into the rpath lets
//! `cargo run`, `cargo test` and binaries launched by `mpirun` or `sbatch` find libtorch with no
//! `LD_LIBRARY_PATH`.

/// Emit the linker arguments that embed libtorch's folder in the rpath of this package's binaries,
/// tests, examples and benches, and keep `libtorch_cuda` linked so CUDA is found when present.
///
/// Call from `build.rs` of a package that lists `torch-sys` among its dependencies.
pub fn link_libtorch_rpath() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        panic!("DEP_TCH_LIBTORCH_LIB is unset: add `torch-sys` to this package's [dependencies]");
    };
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    // torch-sys links libtorch_cuda when it exists; `--as-needed` would drop it because no symbol of
    // it is referenced directly, and then `tch::Cuda::is_available()` is false on GPU machines.
    if std::path::Path::new(&lib).join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
    }
}

/// Compile `files` (C++17, paths relative to the package) against libtorch's headers into the
/// static library `name`, linked into this package: the small autograd nodes and kernels bridges
/// that tch does not expose. Call from `build.rs` of a package that lists `torch-sys` among its
/// dependencies.
pub fn compile_libtorch_cpp(name: &str, files: &[&str]) {
    libtorch_cpp(files).compile(name);
}

/// The build [`compile_libtorch_cpp`] runs, for a caller that adds include folders or defines
/// before compiling it.
pub fn libtorch_cpp(files: &[&str]) -> cc::Build {
    let root = libtorch_lib()
        .parent()
        .expect("libtorch lib folder has a parent")
        .to_path_buf();
    let mut build = cc::Build::new();
    for file in files {
        println!("cargo:rerun-if-changed={file}");
        build.file(file);
    }
    build
        .cpp(true)
        .include(root.join("include"))
        .include(root.join("include/torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag("-D_GLIBCXX_USE_CXX11_ABI=1")
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .warnings(false);
    build
}

/// The folders of CUDA's and NCCL's headers that ship beside the wheel's libtorch (the `nvidia`
/// packages next to `torch/`: the CUDA runtime, crt and cccl, and NCCL), when libtorch was built
/// with CUDA and all of them are there; `None` otherwise, and the NCCL parts are left out.
pub fn cuda_includes() -> Option<Vec<std::path::PathBuf>> {
    let lib = libtorch_lib();
    let nvidia = lib.parent()?.parent()?.join("nvidia");
    let cuda = nvidia.join("cu13/include");
    let folders = vec![cuda.clone(), cuda.join("cccl"), nvidia.join("nccl/include")];
    let needed = [
        lib.join("libtorch_cuda.so"),
        cuda.join("cuda_runtime.h"),
        cuda.join("crt/host_config.h"),
        cuda.join("cccl/nv/target"),
        nvidia.join("nccl/include/nccl.h"),
    ];
    for file in &needed {
        println!("cargo:rerun-if-changed={}", file.display());
    }
    needed.iter().all(|f| f.exists()).then_some(folders)
}

fn libtorch_lib() -> std::path::PathBuf {
    std::path::PathBuf::from(
        std::env::var("DEP_TCH_LIBTORCH_LIB").expect("torch-sys exports its lib dir"),
    )
}
