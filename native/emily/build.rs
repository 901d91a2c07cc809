//! Builds the NIF: generates the op table's Rust NIFs and C++ dispatch, compiles the cxx
//! bridge as C++20 against MLX's headers, and links libmlx (OpenBLAS first on Linux).
#[path = "build/codegen.rs"]
mod codegen;
#[path = "build/optable.rs"]
mod optable;

use std::env;
use std::fs;
use std::path::{Path, PathBuf};

/// The folder holding `mlx/include` and `mlx/lib`: `$EMILY_MLX_DIR`, else the one
/// `scripts/setup` installed (`$EMILY_CACHE/current`, default `~/.cache/emily/current`).
fn mlx_dir() -> PathBuf {
    println!("cargo:rerun-if-env-changed=EMILY_MLX_DIR");
    println!("cargo:rerun-if-env-changed=EMILY_CACHE");
    let dir = match env::var_os("EMILY_MLX_DIR") {
        Some(d) => PathBuf::from(d),
        None => {
            let cache = env::var_os("EMILY_CACHE")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from(env::var("HOME").expect("HOME")).join(".cache/emily"));
            cache.join("current")
        }
    };
    let dir = dir.canonicalize().unwrap_or(dir);
    if !dir.join("mlx/include/mlx/mlx.h").exists() {
        panic!(
            "MLX not found in {} (expected mlx/include/mlx/mlx.h): run scripts/setup or set EMILY_MLX_DIR",
            dir.display()
        );
    }
    dir
}

/// The folders of the CUDA headers (cuda.h, cuda_runtime.h, nvrtc.h) for a CUDA build of
/// MLX: the `nvidia-*` wheels `scripts/setup cuda13` or `cuda12` installs beside it (one
/// folder for CUDA 13, one per wheel for CUDA 12), or `$CUDA_HOME`'s; none for MLX's CPU
/// and Metal builds (no `mlx_cuda_*` wheel there).
fn cuda_includes(mlx: &Path) -> Option<Vec<PathBuf>> {
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    let cuda_wheel = fs::read_dir(mlx).ok()?.flatten().any(|e| {
        let name = e.file_name().to_string_lossy().to_string();
        name.starts_with("mlx_cuda_") && name.ends_with(".dist-info")
    });
    if !cuda_wheel {
        return None;
    }
    let nvidia = mlx.join("nvidia");
    let mut layouts = vec![
        vec![nvidia.join("cu13/include")],
        vec![nvidia.join("cuda_runtime/include"), nvidia.join("cuda_nvrtc/include")],
    ];
    if let Some(home) = env::var_os("CUDA_HOME") {
        layouts.push(vec![PathBuf::from(home).join("include")]);
    }
    let has = |dirs: &Vec<PathBuf>, header: &str| dirs.iter().any(|d| d.join(header).exists());
    let found = layouts.into_iter().find(|dirs| has(dirs, "cuda.h") && has(dirs, "nvrtc.h"));
    // MLX's CUDA backend headers include fmt's (header-only here): Debian's libfmt-dev.
    let fmt =
        ["/usr/include", "/usr/local/include"].iter().any(|d| Path::new(d).join("fmt/format.h").exists());
    if found.is_none() || !fmt {
        println!(
            "cargo:warning=no CUDA headers (cuda.h, nvrtc.h) or fmt headers beside MLX's CUDA build: Emily's CUDA kernels are left out"
        );
        return None;
    }
    found
}

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    let mlx = mlx_dir();

    // --- op table -> Rust NIFs + C++ dispatch -------------------------------------------
    let table_dir = manifest.join("optable");
    println!("cargo:rerun-if-changed={}", table_dir.display());
    let mut files: Vec<PathBuf> = fs::read_dir(&table_dir)
        .expect("optable/")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "ops"))
        .collect();
    files.sort();

    let mut families = Vec::new();
    let mut program_families = Vec::new();
    let mut cpp_files = Vec::new();
    let mut next_id = 0u32;
    let mut seen = std::collections::HashSet::new();
    for path in &files {
        println!("cargo:rerun-if-changed={}", path.display());
        let family = path.file_stem().unwrap().to_string_lossy().to_string();
        let ops =
            optable::parse(&family, &fs::read_to_string(path).unwrap()).unwrap_or_else(|e| panic!("{e}"));
        for op in &ops {
            assert!(seen.insert(op.name.clone()), "op `{}` appears twice in the table", op.name);
        }
        let first = next_id + 1;
        let numbered: Vec<(u32, &optable::Op)> = ops
            .iter()
            .map(|op| {
                next_id += 1;
                (next_id, op)
            })
            .collect();
        let module = manifest.join(format!("src/ops/{family}.rs"));
        let needle = format!("nifs_{family}.rs");
        let generated = ops.iter().any(|op| matches!(op.body, optable::Body::Expr(_)));
        if generated && !fs::read_to_string(&module).is_ok_and(|m| m.contains(&needle)) {
            panic!("{} must include!(concat!(env!(\"OUT_DIR\"), \"/{needle}\"))", module.display());
        }
        write_if_changed(&out.join(&needle), &codegen::rust_nifs(&numbered));
        if generated {
            program_families.push(family.clone());
        }
        let cc = out.join(format!("ops_{family}.cc"));
        write_if_changed(
            &cc,
            &codegen::cpp_family(&family, &numbered, manifest.join(format!("cpp/{family}.h")).exists()),
        );
        cpp_files.push(cc);
        families.push((family, first..next_id + 1));
    }
    write_if_changed(&out.join("program_table.rs"), &codegen::program_table(&program_families));
    let dispatch = out.join("dispatch.cc");
    write_if_changed(&dispatch, &codegen::cpp_dispatch(&families));
    cpp_files.push(dispatch);

    // --- the cxx bridge and the C++ glue ------------------------------------------------
    let cpp_dir = manifest.join("cpp");
    println!("cargo:rerun-if-changed={}", cpp_dir.display());
    println!("cargo:rerun-if-changed=src/bridge.rs");
    for e in fs::read_dir(&cpp_dir).unwrap() {
        let p = e.unwrap().path();
        println!("cargo:rerun-if-changed={}", p.display());
        if p.extension().is_some_and(|x| x == "cc") {
            cpp_files.push(p);
        }
    }
    let mut bridge = cxx_build::bridge("src/bridge.rs");
    if let Some(dirs) = cuda_includes(&mlx) {
        // cpp/cuda_launch.cc compiles Emily's kernels and launches them itself.
        bridge.includes(dirs).define("EMILY_CUDA_LAUNCH", "1").define("FMT_HEADER_ONLY", "1");
    }
    bridge
        .files(&cpp_files)
        .include(&cpp_dir)
        .include(mlx.join("mlx/include"))
        .std("c++20")
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-Wno-deprecated-declarations")
        // cpp/kernels.cc computes MLX's formulas to the bit: no fused a * b + c where the
        // source rounds the product.
        .flag_if_supported("-ffp-contract=off")
        .opt_level(2)
        .compile("emily_bridge");

    // --- linking ------------------------------------------------------------------------
    let lib = mlx.join("mlx/lib");
    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rerun-if-env-changed=EMILY_MLX_RPATH");
    let rpath = env::var("EMILY_MLX_RPATH").unwrap_or_else(|_| lib.display().to_string());
    let target_os = env::var("CARGO_CFG_TARGET_OS").unwrap();
    if target_os == "linux" {
        // OpenBLAS must come ahead of libmlx in the NEEDED list: libmlx's cblas_*/LAPACK
        // symbols then bind to it instead of the wheel's bundled reference BLAS.
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-lopenblas");
        println!("cargo:rustc-link-arg=-lmlx");
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
    } else {
        println!("cargo:rustc-link-lib=dylib=mlx");
    }
    if target_os == "linux" {
        // DT_RPATH, not RUNPATH: it also serves the libraries the NIF's own dependencies
        // need (OpenBLAS's libgfortran, in a bundle that carries them beside the NIF).
        println!("cargo:rustc-link-arg=-Wl,--disable-new-dtags");
    }
    println!("cargo:rustc-link-arg=-Wl,-rpath,{rpath}");
    if target_os == "macos" {
        // NIF symbols resolve against the BEAM at load time.
        println!("cargo:rustc-cdylib-link-arg=-undefined");
        println!("cargo:rustc-cdylib-link-arg=dynamic_lookup");
    }
}

fn write_if_changed(path: &Path, text: &str) {
    if fs::read_to_string(path).ok().as_deref() != Some(text) {
        fs::write(path, text).unwrap();
    }
}
