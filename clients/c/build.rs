//! Gives libstator.so its SONAME, so programs linked against it ask for
//! the ABI they were built with (`libstator.so.<STATOR_ABI_VERSION>`).

fn main() {
    // Keep in step with STATOR_ABI_VERSION in src/lib.rs.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libstator.so.1");
    println!("cargo:rerun-if-changed=build.rs");
}
