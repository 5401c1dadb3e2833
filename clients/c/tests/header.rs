//! `include/stator.h` is what cbindgen makes of `src/` today: a change to
//! the C ABI without the regenerated header fails here (and so in CI).
//! `STATOR_BLESS=1 cargo test -p stator-c --test header` rewrites it.

use std::path::Path;

#[test]
fn checked_in_header_is_current() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut fresh = Vec::new();
    cbindgen::Builder::new()
        .with_crate(dir)
        .with_config(config)
        .generate()
        .expect("cbindgen generates stator.h")
        .write(&mut fresh);
    let path = dir.join("include/stator.h");
    if std::env::var_os("STATOR_BLESS").is_some() {
        std::fs::write(&path, &fresh).expect("write stator.h");
        return;
    }
    let old = std::fs::read(&path).unwrap_or_default();
    assert!(
        old == fresh,
        "{} is out of date with clients/c/src: run `STATOR_BLESS=1 cargo test -p stator-c --test header` and commit it",
        path.display()
    );
}
