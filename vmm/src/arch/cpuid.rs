//! Per-vCPU CPUID: KVM's supported set with this vCPU's APIC id and the VM's topology
//! (one socket, one thread per core, `vcpus` cores).

use kvm_bindings::{kvm_cpuid_entry2, CpuId};

const LEAF_FEATURES: u32 = 0x1;
const LEAF_CACHE_PARAMS: u32 = 0x4;
const LEAF_EXT_TOPOLOGY: u32 = 0xb;
const LEAF_V2_EXT_TOPOLOGY: u32 = 0x1f;
const LEAF_AMD_SIZE_IDS: u32 = 0x8000_0008;
const LEAF_AMD_EXT_APIC_ID: u32 = 0x8000_001e;

const EDX_HTT: u32 = 1 << 28;
const ECX_HYPERVISOR: u32 = 1 << 31;
const LEVEL_TYPE_SMT: u32 = 1;
const LEVEL_TYPE_CORE: u32 = 2;

/// Bits needed to number `n` cores (ceil(log2 n)).
fn id_bits(n: u32) -> u32 {
    if n <= 1 {
        0
    } else {
        32 - (n - 1).leading_zeros()
    }
}

fn patch_entry(e: &mut kvm_cpuid_entry2, apic_id: u32, vcpus: u32) {
    match e.function {
        LEAF_FEATURES => {
            // EBX: [31:24] initial APIC id, [23:16] logical processors, [15:8] CLFLUSH size / 8.
            e.ebx = (apic_id << 24) | ((vcpus.min(255)) << 16) | (8 << 8);
            if vcpus > 1 {
                e.edx |= EDX_HTT;
            } else {
                e.edx &= !EDX_HTT;
            }
            e.ecx |= ECX_HYPERVISOR;
        }
        LEAF_CACHE_PARAMS => {
            // EAX[31:26]: cores per package - 1; keep the cache description KVM gave.
            e.eax = (e.eax & 0x03ff_ffff) | ((vcpus.saturating_sub(1) & 0x3f) << 26);
        }
        LEAF_EXT_TOPOLOGY | LEAF_V2_EXT_TOPOLOGY => {
            e.edx = apic_id;
            match e.index {
                0 => {
                    e.eax = 0;
                    e.ebx = 1;
                    e.ecx = (LEVEL_TYPE_SMT << 8) | e.index;
                }
                1 => {
                    e.eax = id_bits(vcpus);
                    e.ebx = vcpus;
                    e.ecx = (LEVEL_TYPE_CORE << 8) | e.index;
                }
                _ => {
                    e.eax = 0;
                    e.ebx = 0;
                    e.ecx = e.index;
                }
            }
        }
        LEAF_AMD_SIZE_IDS => {
            // ECX[15:12] APIC id size, [7:0] threads - 1.
            e.ecx = (id_bits(vcpus) << 12) | (vcpus.saturating_sub(1) & 0xff);
        }
        LEAF_AMD_EXT_APIC_ID => {
            e.eax = apic_id;
            e.ebx = apic_id & 0xff; // core id, one thread per core
            e.ecx = 0; // node 0
        }
        _ => {}
    }
}

/// Returns `supported` adjusted for vCPU `index` of `vcpus`.
pub fn for_vcpu(supported: &CpuId, index: u32, vcpus: u32) -> CpuId {
    let mut cpuid = supported.clone();
    for e in cpuid.as_mut_slice() {
        patch_entry(e, index, vcpus);
    }
    cpuid
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(function: u32, index: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            index,
            ..Default::default()
        }
    }

    #[test]
    fn apic_ids_and_topology_per_vcpu() {
        let supported = CpuId::from_entries(&[
            entry(LEAF_FEATURES, 0),
            entry(LEAF_EXT_TOPOLOGY, 0),
            entry(LEAF_EXT_TOPOLOGY, 1),
            entry(LEAF_EXT_TOPOLOGY, 2),
            entry(LEAF_AMD_EXT_APIC_ID, 0),
        ])
        .unwrap();
        let c = for_vcpu(&supported, 3, 4);
        let e = c.as_slice();
        assert_eq!(e[0].ebx >> 24, 3);
        assert_eq!((e[0].ebx >> 16) & 0xff, 4);
        assert_ne!(e[0].edx & EDX_HTT, 0);
        assert_ne!(e[0].ecx & ECX_HYPERVISOR, 0);
        assert_eq!((e[1].edx, e[1].ebx, e[1].ecx >> 8), (3, 1, LEVEL_TYPE_SMT));
        assert_eq!((e[2].eax, e[2].ebx, e[2].ecx >> 8), (2, 4, LEVEL_TYPE_CORE));
        assert_eq!(e[3].ecx & 0xff00, 0);
        assert_eq!(e[4].eax, 3);
        let one = for_vcpu(&supported, 0, 1);
        assert_eq!(one.as_slice()[0].edx & EDX_HTT, 0);
    }

    #[test]
    fn id_bits_rounds_up() {
        assert_eq!([1, 2, 3, 4, 5, 8, 9].map(id_bits), [0, 1, 2, 2, 3, 3, 4]);
    }
}
