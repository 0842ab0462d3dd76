//! `clade fork` (through a running VM's API socket) and `clade fork-child`, the hidden
//! child mode. The parent's side of a process fork and the child's start-up are the
//! library's ([`vmm::host::fork_processes`], [`vmm::host::serve_fork_child`]).

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;
use vmm::api::{ApiClient, Request};
use vmm::host::{serve_fork_child, serve_prestarted_fork_child};

use super::run::{owner_options, report_end};

#[derive(Debug, Args)]
pub struct ForkArgs {
    /// The VM's API socket (`clade run --api-sock`, `clade resume --api-sock`, or a child's).
    api_sock: PathBuf,
    /// Number of children.
    #[arg(short = 'n', long = "count", default_value_t = 1)]
    count: usize,
    /// Directory for the children's sockets, serial consoles and logs (default: the
    /// directory of the VM's API socket).
    #[arg(long, value_name = "DIR")]
    prefix: Option<PathBuf>,
    /// Do not give the children's guest agents the time, entropy and a hostname suffix.
    #[arg(long)]
    no_agent_sync: bool,
    /// A child's TAP, as `clade run --net` takes it (`tap=NAME[,netns=PATH]`); once per
    /// child, in order, required when the VM has a network device (each child needs its
    /// own TAP: the same name in its own network namespace keeps the guest's addresses).
    #[arg(long = "net", value_name = "SPEC")]
    nets: Vec<String>,
    /// Print the VM's answer as one JSON object.
    #[arg(long)]
    json: bool,
}

pub fn fork(args: ForkArgs) -> anyhow::Result<u8> {
    if args.count == 0 {
        bail!("-n must be at least 1");
    }
    let prefix = args
        .prefix
        .as_deref()
        .map(std::path::absolute)
        .transpose()
        .context("cannot make the --prefix path absolute")?;
    let mut client = ApiClient::connect(&args.api_sock)
        .with_context(|| format!("API socket {}", args.api_sock.display()))?;
    let r = client.call(&Request::Fork {
        count: args.count,
        prefix,
        agent_sync: !args.no_agent_sync,
        nets: args.nets,
    })?;
    if !r.ok {
        bail!(
            "fork failed: {}",
            r.error.unwrap_or_else(|| "no reason given".into())
        );
    }
    if args.json {
        println!("{}", serde_json::Value::Object(r.fields));
        return Ok(0);
    }
    let children = r
        .fields
        .get("children")
        .and_then(|c| c.as_array())
        .cloned()
        .unwrap_or_default();
    for c in &children {
        let s = |k: &str| c[k].as_str().unwrap_or("-").to_string();
        println!("{} {}", s("api_sock"), s("vsock"));
    }
    Ok(0)
}

#[derive(Debug, Args)]
pub struct ForkChildArgs {
    /// The child's API socket, as the parent named it (the launch record on stdin is
    /// authoritative; this names the process in listings and is checked against it).
    #[arg(long, conflicts_with = "prestarted_for")]
    api_sock: Option<PathBuf>,
    /// Started ahead of a fork of the VM whose API socket this is: stdin is a socket to
    /// that VM's process; build the VM shell it names, then wait for a fork (see
    /// [`vmm::host::serve_prestarted_fork_child`]).
    #[arg(long, value_name = "PARENT_API_SOCK")]
    prestarted_for: Option<PathBuf>,
}

/// `clade fork-child`: becomes one child of a fork (everything it needs arrives on stdin,
/// see [`vmm::host::serve_fork_child`]), then runs like `clade run`.
pub fn fork_child(args: ForkChildArgs) -> anyhow::Result<u8> {
    // A child takes its parent's files root (in the hand-over) and keeps no waiting
    // children of its own.
    let options = owner_options(None, true, 0)?;
    let end = if args.prestarted_for.is_some() {
        match serve_prestarted_fork_child(&options)? {
            Some(end) => end,
            // The parent ended before it forked: nothing ran here.
            None => return Ok(0),
        }
    } else {
        serve_fork_child(&options, args.api_sock.as_deref())?
    };
    report_end(&end);
    Ok(end.exit_code())
}
