//! Build-script helper shared by every crate whose binaries or tests link libtorch.
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
