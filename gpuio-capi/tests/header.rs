//! include/gpuio.h is what cbindgen generates from the crate now: a changed entry point, struct
//! or comment without a regenerated header fails here. `GPUIO_BLESS=1` rewrites the header.

use std::path::Path;

#[test]
fn checked_in_header_matches_the_code() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml"))
        .expect("gpuio-capi/cbindgen.toml parses");
    let bindings = cbindgen::Builder::new()
        .with_crate(crate_dir)
        .with_config(config)
        .generate()
        .expect("cbindgen generates the header");
    let mut generated = Vec::new();
    bindings.write(&mut generated);
    let generated = String::from_utf8(generated).expect("the header is UTF-8");
    let path = crate_dir.join("include/gpuio.h");
    if std::env::var_os("GPUIO_BLESS").is_some() {
        std::fs::write(&path, &generated).expect("include/gpuio.h is writable");
        return;
    }
    let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
    if checked_in != generated {
        let line = checked_in
            .lines()
            .zip(generated.lines())
            .position(|(a, b)| a != b)
            .map_or_else(
                || "at the end".to_string(),
                |i| format!("at line {}", i + 1),
            );
        panic!(
            "gpuio-capi/include/gpuio.h differs from what cbindgen generates ({line}); \
             regenerate it with GPUIO_BLESS=1 cargo test -p gpuio-capi --test header"
        );
    }
}
