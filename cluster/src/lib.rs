//! A Clade cluster: many `clade serve` nodes behind one E2B endpoint.
//!
//! Shared state is PostgreSQL ([`db`]): the nodes, each with a lease it keeps alive, and
//! which node owns each sandbox, with a fencing token. Sandboxes' bytes are in the object
//! store of durable sandboxes (`sandbox::durable`): a paused sandbox any node may resume.
//! Nothing here is consensus or storage of our own: the database's row locks decide races
//! and its clock measures leases, the store's create-if-absent claims decide which node
//! resumes a pause.
//!
//! | module | what |
//! |---|---|
//! | [`db`] | the registry in PostgreSQL: nodes, leases, ownership, template shapes |
//! | [`node`] | this node: its lease, what it records of its sandboxes, its drain |
//! | [`gateway`] | in front of the E2B API: which node answers a request |
//! | [`placement`] | which node takes a new or moving sandbox |
//! | [`hop`] | a request forwarded to another node, streamed both ways |
//! | [`tls`] | TLS of both links: to PostgreSQL (`sslmode`), between nodes (the cluster CA) |
//!
//! A node owns the sandboxes it created, forked, resumed or took over. Before it changes
//! one it asks the registry (`sandbox::ownership`): a node whose lease ended (stopped,
//! partitioned, slow) or whose sandbox another node took is refused, and forgets its copy.

pub mod db;
pub mod error;
pub mod gateway;
pub mod hop;
pub mod node;
pub mod placement;
pub mod tls;

pub use error::{Error, Result};
pub use node::{Node, NodeConfig};

/// The header a request forwarded by another node carries: the cluster secret. A request
/// with it is answered here, never forwarded again.
pub const HOP_HEADER: &str = "x-clade-cluster-hop";
