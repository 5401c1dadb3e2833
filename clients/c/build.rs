//! Gives libstator.so its SONAME, `libstator.so.<STATOR_ABI_VERSION>`, so
//! programs linked against it ask for the ABI they were built with. The
//! version is read from src/lib.rs, its one definition.

fn main() {
    println!("cargo:rerun-if-changed=src/lib.rs");
    let lib = std::fs::read_to_string("src/lib.rs").expect("read src/lib.rs");
    let abi = lib
        .lines()
        .find_map(|l| l.strip_prefix("pub const STATOR_ABI_VERSION: u32 = "))
        .and_then(|v| v.strip_suffix(';'))
        .expect("src/lib.rs defines `pub const STATOR_ABI_VERSION: u32 = N;`");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libstator.so.{abi}");
}
