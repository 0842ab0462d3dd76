//! The defaults an image's config gives a container of it, as a template takes them.

use oci_spec::image::ImageConfiguration;
use serde::{Deserialize, Serialize};

/// `Env`, `WorkingDir`, `User`, `Entrypoint` and `Cmd` of an image config.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageDefaults {
    /// Environment, in order (`NAME=value` split at the first `=`).
    pub env: Vec<(String, String)>,
    /// Working directory ("" when unset: the user's home, as E2B does).
    pub cwd: String,
    /// User (name, uid, or `user:group`; "" when unset: root).
    pub user: String,
    /// Entrypoint.
    pub entrypoint: Vec<String>,
    /// Cmd (arguments of the entrypoint, or the command).
    pub cmd: Vec<String>,
}

impl ImageDefaults {
    /// From a parsed config.
    pub fn from_config(c: &ImageConfiguration) -> ImageDefaults {
        let Some(cfg) = c.config() else {
            return ImageDefaults::default();
        };
        let env = cfg
            .env()
            .iter()
            .flatten()
            .map(|kv| match kv.split_once('=') {
                Some((k, v)) => (k.to_string(), v.to_string()),
                None => (kv.clone(), String::new()),
            })
            .collect();
        ImageDefaults {
            env,
            cwd: cfg.working_dir().clone().unwrap_or_default(),
            user: cfg.user().clone().unwrap_or_default(),
            entrypoint: cfg.entrypoint().clone().unwrap_or_default(),
            cmd: cfg.cmd().clone().unwrap_or_default(),
        }
    }

    /// The start command: entrypoint then cmd (empty when neither is set).
    pub fn start_command(&self) -> Vec<String> {
        self.entrypoint.iter().chain(&self.cmd).cloned().collect()
    }
}
