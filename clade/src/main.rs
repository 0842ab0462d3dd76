//! `clade`: a thin command-line shell over the `vmm` library.

mod cli;

use std::process::ExitCode;

use clap::Parser;

/// Descriptors the process's table holds from the start: grown now, while the process has
/// one thread, it costs nothing; grown later, each doubling waits for an RCU grace period
/// (see `vmm::reserve_fd_table`).
const STARTUP_FD_TABLE: usize = 1024;

fn main() -> ExitCode {
    let args = cli::Cli::parse();
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colours only for a terminal: a VM process's log is a file whose tail becomes an
        // API error's message.
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CLADE_LOG")
                // virtio-queue logs each malformed queue access the guest makes, without a
                // limit; the devices report those themselves, rate-limited.
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,virtio_queue=off")),
        )
        .init();
    vmm::reserve_fd_table(&std::io::stderr(), STARTUP_FD_TABLE);
    match cli::dispatch(args) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("clade: {}", one_line(&e));
            ExitCode::from(1)
        }
    }
}

/// The error and its causes on one line. Library errors already quote their source in their
/// own message, so a cause whose text is already there is not repeated.
fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line.replace('\n', " ")
}
