//! Placement: which node takes a sandbox. A node takes one when its lease is alive, it
//! takes sandboxes, it is not draining, and what its running sandboxes commit plus the new
//! one stays within its capacity. Among those, nodes with the template in their local cache
//! come first (a create from the cache needs no fetch from the store), then the node
//! preferred by the caller (the one the request entered, or where a sandbox paused), then
//! the one with the most free memory.
//!
//! Placement reads the registry's view of what is committed; two creates placed at the
//! same moment may both take the last room on a node (the node's own limits then apply).

use crate::db::NodeRow;

/// The nodes that can take a sandbox of this shape, best first: live, taking sandboxes,
/// not draining, with room; those with the template cached first, then `prefer`, then the
/// most free memory.
pub fn choose(
    nodes: &[NodeRow],
    vcpus: u32,
    mem_mib: u64,
    template: &str,
    prefer: Option<&str>,
) -> Vec<NodeRow> {
    let mut ok: Vec<NodeRow> = nodes
        .iter()
        .filter(|n| n.live && n.takes_sandboxes && !n.draining)
        .filter(|n| {
            n.used_vcpus + vcpus as i64 <= n.vcpus as i64
                && n.used_mem_mib + mem_mib as i64 <= n.mem_mib
        })
        .cloned()
        .collect();
    ok.sort_by_key(|n| {
        (
            !n.templates.iter().any(|t| t == template),
            prefer != Some(n.name.as_str()),
            -(n.mem_mib - n.used_mem_mib),
            n.name.clone(),
        )
    });
    ok
}

/// The node template builds run on: the live node that takes sandboxes and is not
/// draining, first by name, so that every node asked sends a build's requests (its
/// upload, its status polls) to the same one.
pub fn builder(nodes: &[NodeRow]) -> Option<&NodeRow> {
    nodes
        .iter()
        .filter(|n| n.live && n.takes_sandboxes && !n.draining)
        .min_by(|a, b| a.name.cmp(&b.name))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, vcpus: i32, mem: i64, used: (i64, i64), templates: &[&str]) -> NodeRow {
        NodeRow {
            name: name.into(),
            address: format!("http://{name}:1"),
            vcpus,
            mem_mib: mem,
            takes_sandboxes: true,
            draining: false,
            drained: false,
            templates: templates.iter().map(|s| s.to_string()).collect(),
            live: true,
            lease_left_s: 1.0,
            used_vcpus: used.0,
            used_mem_mib: used.1,
            sandboxes: 0,
        }
    }

    #[test]
    fn placement_wants_room_then_the_template_then_free_memory() {
        let nodes = vec![
            node("a", 4, 1024, (4, 512), &["t"]),
            node("b", 4, 1024, (0, 0), &[]),
            node("c", 4, 2048, (1, 512), &["t"]),
        ];
        let names = |v: Vec<NodeRow>| v.into_iter().map(|n| n.name).collect::<Vec<_>>();
        // a is full (vCPUs); c has the template.
        assert_eq!(names(choose(&nodes, 1, 256, "t", None)), ["c", "b"]);
        // Without the template anywhere: most free memory first.
        assert_eq!(names(choose(&nodes, 1, 256, "u", None)), ["c", "b"]);
        assert_eq!(names(choose(&nodes, 1, 256, "u", Some("b"))), ["b", "c"]);
        // Nothing fits.
        assert!(choose(&nodes, 8, 256, "t", None).is_empty());
        let mut dead = nodes.clone();
        for n in &mut dead {
            n.live = false;
        }
        assert!(choose(&dead, 1, 1, "t", None).is_empty());
        let mut draining = nodes;
        draining[2].draining = true;
        assert_eq!(names(choose(&draining, 1, 256, "t", None)), ["b"]);
    }

    #[test]
    fn builds_go_to_the_first_live_taker_by_name() {
        let mut nodes = vec![
            node("c", 4, 1024, (0, 0), &[]),
            node("a", 4, 1024, (4, 1024), &[]),
            node("b", 4, 1024, (0, 0), &[]),
        ];
        // Full or not: a build is not a sandbox.
        assert_eq!(builder(&nodes).map(|n| n.name.as_str()), Some("a"));
        nodes[1].draining = true;
        nodes[2].live = false;
        assert_eq!(builder(&nodes).map(|n| n.name.as_str()), Some("c"));
        nodes[0].takes_sandboxes = false;
        assert!(builder(&nodes).is_none());
    }
}
