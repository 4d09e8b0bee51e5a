//! Every misuse of `#[diffusion_block]` is a compile error at the user's span, with the message
//! checked in beside each case (tests/ui/*.stderr); the pass cases (tests/ui_pass/) compile and
//! run.

#[test]
fn misuse_is_reported_at_the_users_span_and_generic_blocks_work() {
    // The pass cases run: their binaries find libtorch where scripts/setup.sh links it.
    let libtorch = concat!(env!("CARGO_MANIFEST_DIR"), "/../.libtorch/lib");
    let path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    std::env::set_var("LD_LIBRARY_PATH", format!("{libtorch}:{path}"));
    let cases = trybuild::TestCases::new();
    cases.compile_fail("tests/ui/*.rs");
    cases.pass("tests/ui_pass/*.rs");
}
