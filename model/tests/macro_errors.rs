//! Every misuse of `#[diffusion_block]` is a compile error at the user's span, with the message
//! checked in beside each case (tests/ui/*.stderr).

#[test]
fn misuse_is_reported_at_the_users_span() {
    let cases = trybuild::TestCases::new();
    cases.compile_fail("tests/ui/*.rs");
}
