//! Kernel command line: located through the Linux boot_params zero page and
//! split into the tokens this guest understands.

/// Offset of the u32 `cmd_line_ptr` in struct boot_params.
const CMD_LINE_PTR: u64 = 0x228;
/// Longest command line we look at (Linux x86 uses 2048).
const MAX_LEN: usize = 4096;

/// Returns the NUL-terminated command line as bytes (empty if absent).
///
/// # Safety
/// `boot_params` must be 0 or the address of a readable zero page whose
/// `cmd_line_ptr` is 0 or points to a NUL-terminated string.
pub unsafe fn from_boot_params(boot_params: u64) -> &'static [u8] {
    if boot_params == 0 {
        return &[];
    }
    let ptr =
        core::ptr::read_volatile((boot_params + CMD_LINE_PTR) as *const u32) as usize as *const u8;
    if ptr.is_null() {
        return &[];
    }
    let mut len = 0;
    while len < MAX_LEN && *ptr.add(len) != 0 {
        len += 1;
    }
    core::slice::from_raw_parts(ptr, len)
}

pub struct Args<'a> {
    /// Comma-separated step list (`steps=`), default "hello".
    pub steps: &'a str,
    /// Guest-physical address of the PVM virtual-interrupt-flag cell
    /// (`clade.vif=0x...`); None on hardware KVM.
    pub vif: Option<u64>,
    /// The `vsock` step's settings (`poll_us=`, `conn_log=`).
    pub vsock: crate::vsock::Tuning,
}

impl<'a> Args<'a> {
    /// Unknown tokens are ignored (the VMM may add its own); the last
    /// occurrence of a known key wins.
    pub fn parse(line: &'a [u8]) -> Result<Args<'a>, &'static str> {
        let line = core::str::from_utf8(line).map_err(|_| "not UTF-8")?;
        let mut args = Args {
            steps: "hello",
            vif: None,
            vsock: crate::vsock::Tuning::default(),
        };
        for tok in line.split_ascii_whitespace() {
            if let Some(v) = tok.strip_prefix("steps=") {
                args.steps = v;
            } else if let Some(v) = tok.strip_prefix("poll_us=") {
                args.vsock.poll_us = v.parse().map_err(|_| "bad poll_us= value")?;
            } else if let Some(v) = tok.strip_prefix("conn_log=") {
                args.vsock.conn_log = match v {
                    "0" => false,
                    "1" => true,
                    _ => return Err("bad conn_log= value (0 or 1)"),
                };
            } else if let Some(v) = tok.strip_prefix("clade.vif=") {
                let hex = v
                    .strip_prefix("0x")
                    .or_else(|| v.strip_prefix("0X"))
                    .unwrap_or(v);
                match u64::from_str_radix(hex, 16) {
                    Ok(addr) if addr != 0 => args.vif = Some(addr),
                    _ => return Err("bad clade.vif= value"),
                }
            }
        }
        Ok(args)
    }
}
