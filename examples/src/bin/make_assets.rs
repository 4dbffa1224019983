//! Regenerates the bundled assets: `cargo run -p trl-examples --bin make_assets [DIR]`
//! (default: assets/tiny in the repository).

fn main() -> std::process::ExitCode {
    let dir = std::env::args()
        .nth(1)
        .map(std::path::PathBuf::from)
        .unwrap_or_else(trl_examples::assets::default_dir);
    match trl_examples::assets::write_all(&dir) {
        Ok(()) => {
            eprintln!("wrote {}", dir.display());
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
