//! Host CPU identity recorded in, and checked against, snapshot state files.

use std::fmt;

/// CPU vendor and family/model/stepping, from CPUID leaves 0 and 1.
#[derive(Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct CpuId {
    /// Vendor string, e.g. `AuthenticAMD`, `GenuineIntel`.
    pub vendor: [u8; 12],
    /// Display family (base family + extended family when the base family is 0xf).
    pub family: u16,
    /// Display model (extended model included for families 6 and 0xf).
    pub model: u8,
    /// Stepping.
    pub stepping: u8,
}

impl CpuId {
    /// The CPU this code runs on.
    #[cfg(target_arch = "x86_64")]
    pub fn host() -> CpuId {
        use core::arch::x86_64::__cpuid;
        let leaf0 = __cpuid(0);
        let mut vendor = [0u8; 12];
        vendor[0..4].copy_from_slice(&leaf0.ebx.to_le_bytes());
        vendor[4..8].copy_from_slice(&leaf0.edx.to_le_bytes());
        vendor[8..12].copy_from_slice(&leaf0.ecx.to_le_bytes());
        let eax = if leaf0.eax >= 1 { __cpuid(1).eax } else { 0 };
        Self::from_signature(vendor, eax)
    }

    /// The CPU this code runs on (non-x86: an all-zero identity).
    #[cfg(not(target_arch = "x86_64"))]
    pub fn host() -> CpuId {
        Self::from_signature([0; 12], 0)
    }

    /// Decode the CPUID leaf 1 EAX signature.
    pub fn from_signature(vendor: [u8; 12], eax: u32) -> CpuId {
        let stepping = (eax & 0xf) as u8;
        let base_model = (eax >> 4) & 0xf;
        let base_family = (eax >> 8) & 0xf;
        let ext_model = (eax >> 16) & 0xf;
        let ext_family = (eax >> 20) & 0xff;
        let family = if base_family == 0xf {
            base_family + ext_family
        } else {
            base_family
        };
        let model = if base_family == 0x6 || base_family == 0xf {
            (ext_model << 4) | base_model
        } else {
            base_model
        };
        CpuId {
            vendor,
            family: family as u16,
            model: model as u8,
            stepping,
        }
    }

    /// The vendor string, lossily decoded.
    pub fn vendor_str(&self) -> String {
        String::from_utf8_lossy(&self.vendor)
            .trim_end_matches('\0')
            .to_string()
    }
}

impl fmt::Display for CpuId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} family {:#x} model {:#x} stepping {}",
            self.vendor_str(),
            self.family,
            self.model,
            self.stepping
        )
    }
}

impl fmt::Debug for CpuId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CpuId({self})")
    }
}

/// How strictly a snapshot's CPU must match the host's to be restored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CpuCheck {
    /// Vendor, family, model and stepping must all match.
    Exact,
    /// Vendor, family and model must match; stepping may differ (the default: CPUID and
    /// MSR state are not portable across models).
    #[default]
    SameModel,
    /// Only the vendor must match.
    SameVendor,
    /// No check (tests, tooling).
    Ignore,
}

impl CpuCheck {
    /// Whether a snapshot taken on `snapshot` may be restored on `host`.
    pub fn accepts(self, snapshot: &CpuId, host: &CpuId) -> bool {
        match self {
            CpuCheck::Exact => snapshot == host,
            CpuCheck::SameModel => {
                snapshot.vendor == host.vendor
                    && snapshot.family == host.family
                    && snapshot.model == host.model
            }
            CpuCheck::SameVendor => snapshot.vendor == host.vendor,
            CpuCheck::Ignore => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_cpu_has_a_vendor() {
        let cpu = CpuId::host();
        assert!(!cpu.vendor_str().is_empty());
        assert_eq!(CpuId::host(), cpu);
    }

    #[test]
    fn signature_decoding() {
        // AMD EPYC 7B13 (Zen 3): family 0x19, model 0x01, stepping 1: eax = 0x00a00f11.
        let c = CpuId::from_signature(*b"AuthenticAMD", 0x00a0_0f11);
        assert_eq!((c.family, c.model, c.stepping), (0x19, 0x01, 1));
        // Intel Skylake-SP: family 6, model 0x55, stepping 4: eax = 0x00050654.
        let i = CpuId::from_signature(*b"GenuineIntel", 0x0005_0654);
        assert_eq!((i.family, i.model, i.stepping), (6, 0x55, 4));
        assert_eq!(i.vendor_str(), "GenuineIntel");
    }

    #[test]
    fn check_levels() {
        let a = CpuId::from_signature(*b"AuthenticAMD", 0x00a0_0f11);
        let stepping = CpuId { stepping: 2, ..a };
        let model = CpuId { model: 0x21, ..a };
        let intel = CpuId::from_signature(*b"GenuineIntel", 0x00a0_0f11);
        assert!(CpuCheck::Exact.accepts(&a, &a));
        assert!(!CpuCheck::Exact.accepts(&a, &stepping));
        assert!(CpuCheck::SameModel.accepts(&a, &stepping));
        assert!(!CpuCheck::SameModel.accepts(&a, &model));
        assert!(CpuCheck::SameVendor.accepts(&a, &model));
        assert!(!CpuCheck::SameVendor.accepts(&a, &intel));
        assert!(CpuCheck::Ignore.accepts(&a, &intel));
    }
}
