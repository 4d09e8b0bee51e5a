fn main() {
    flux_build::link_libtorch_rpath();
}
