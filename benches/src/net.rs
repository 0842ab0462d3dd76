//! `--net` of the restore and fork scenarios: sandbox networks (the `hostnet` crate, as
//! `clade serve` makes them) in a range and with names of this process's own, made before
//! the measurement and removed when dropped. Each one's TAP is opened ahead as well, as
//! the service's pool does (and hands the descriptor to the VM process that restores):
//! attaching to a TAP is not on a restore's path.

use std::time::Instant;

use crate::error::{Error, Result};
use crate::stats::Samples;

fn err(e: hostnet::Error) -> Error {
    Error::Guest(format!("--net (needs root and nft): {e}"))
}

/// `n` sandbox networks, indexes 0..n.
pub(crate) struct BenchNets {
    /// Closed before their networks are removed (fields drop in this order).
    taps: Vec<std::sync::Arc<vmm::Tap>>,
    range: hostnet::NetRange,
    nets: Vec<hostnet::SandboxNet>,
}

impl BenchNets {
    pub(crate) fn new(n: usize) -> Result<BenchNets> {
        let pid = std::process::id();
        let cidr = hostnet::parse_cidr(&format!("10.255.{}.0/24", pid % 250)).map_err(err)?;
        let range =
            hostnet::NetRange::new(cidr, &format!("cbn{}", pid % 100_000), "cb").map_err(err)?;
        // Whatever an earlier, killed run with this pid left.
        let _ = hostnet::sweep(&range, &[]);
        let nets = (0..n as u32)
            .map(|i| hostnet::SandboxNet::create(&range, i).map_err(err))
            .collect::<Result<Vec<_>>>()?;
        let taps = nets
            .iter()
            .map(|n| {
                vmm::open_tap(&vmm::NetConfig {
                    tap: vmm::TapSource::Name(n.tap_name().into()),
                    mac: None,
                    netns: Some(n.netns_path().to_path_buf()),
                })
                .map_err(|e| Error::Guest(format!("--net: opening TAP {}: {e}", n.tap_name())))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(BenchNets { taps, range, nets })
    }

    /// The VMM's TAP of network `i`, opened ahead.
    pub(crate) fn config(&self, i: usize) -> vmm::NetConfig {
        vmm::NetConfig {
            tap: vmm::TapSource::Open(std::sync::Arc::clone(&self.taps[i])),
            mac: None,
            netns: None,
        }
    }

    /// Makes and removes `n` more networks, timing each (what a pool's refill costs).
    pub(crate) fn setup_cost(&self, n: usize) -> Result<(Samples, Samples)> {
        let (mut create, mut destroy) = (Samples::new(), Samples::new());
        let spare = self.nets.len() as u32;
        for _ in 0..n {
            let t = Instant::now();
            let extra = hostnet::SandboxNet::create(&self.range, spare).map_err(err)?;
            create.push(t.elapsed());
            let t = Instant::now();
            extra.destroy().map_err(err)?;
            destroy.push(t.elapsed());
        }
        Ok((create, destroy))
    }
}
