//! Every misuse of #[derive(Parallelize)] is a compile error with a span and a message saying
//! what to do; each case in tests/ui has its expected compiler output beside it
//! (`TRYBUILD=overwrite cargo test -p trl-runtime --test macro_errors` regenerates them).

#[test]
fn misuses_are_compile_errors() {
    let cases = trybuild::TestCases::new();
    cases.compile_fail("tests/ui/*.rs");
}
