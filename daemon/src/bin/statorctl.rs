//! `statorctl`: the operator's command line for statord.
//!
//! Commands so far: `check-config FILE`. (Those that ask a running daemon,
//! through its status socket, come with that socket.)
//!
//! Exit codes: 0 success; 1 the command could not run (a file that cannot
//! be read); 2 the input is invalid (a configuration key, a syntax error).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use statord::config::{Config, ConfigError};

#[derive(Parser, Debug)]
#[command(
    name = "statorctl",
    version,
    about = "Operate statord: check its configuration",
    after_help = "Exit codes: 0 success, 1 the command could not run, 2 invalid input."
)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Checks a statord configuration file as statord would read it (the
    /// embedded defaults, then the file), and prints what it resolves to:
    /// shards, memory budget and every limit. Exit 2 names the bad key.
    CheckConfig {
        /// The TOML file (keys as in README.md, "Running statord").
        file: PathBuf,
        /// Print nothing on success; only the exit code tells.
        #[arg(long, short)]
        quiet: bool,
    },
}

fn main() -> ExitCode {
    match Args::parse().command {
        Command::CheckConfig { file, quiet } => {
            match Config::from_file(&file).and_then(Config::resolve) {
                Ok(c) => {
                    if !quiet {
                        println!("{}: valid; statord would run with:\n{c:#?}", file.display());
                    }
                    ExitCode::SUCCESS
                }
                Err(e @ ConfigError::Read { .. }) => {
                    eprintln!("statorctl: {e}");
                    ExitCode::from(1)
                }
                Err(e) => {
                    eprintln!("statorctl: {e}");
                    ExitCode::from(2)
                }
            }
        }
    }
}
