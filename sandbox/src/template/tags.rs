//! Tags: which build of a template a reference means (E2B's `name:tag`).
//!
//! A template `name` may have several builds: its own directory `templates/<name>/` (what
//! `clade template build` and an untagged service build make), and `templates/<name>@<build
//! id>/` for each service build made with other tags. `templates/.tags/<name>.json` maps
//! each tag to the build it means (`default` is what `name` alone means). A template with
//! no such file has one tag, `default`, on its own directory: every template built before
//! tags existed keeps working unchanged.
//!
//! The file is changed under an exclusive lock of `templates/.tags/<name>.lock` and
//! replaced atomically, so concurrent requests neither lose a tag nor read half a file.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{valid_name, TemplateStore};
use crate::error::{Error, Result};

/// The tag a reference without one means.
pub const DEFAULT_TAG: &str = "default";
/// Tags a template may have (E2B's limit).
pub const MAX_TAGS: usize = 20;

/// What `templates/.tags/<name>.json` records.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TagFile {
    /// Each tag and the build it means.
    #[serde(default)]
    pub tags: BTreeMap<String, Tagged>,
    /// E2B's `public` flag of the template (recorded and shown; this host has one team).
    #[serde(default)]
    pub public: bool,
}

/// The build a tag means.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tagged {
    /// The build's directory name under `templates/` (`name` or `name@<build id>`).
    pub build: String,
    /// When the tag was put there (ms since the epoch).
    pub created_ms: i64,
}

/// A tag as listed: the tag, its build's id, when it was put there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TagInfo {
    pub tag: String,
    pub build_id: String,
    pub created_ms: i64,
}

/// `[team/]name[:tag]` split into the template's name and its tag (`None`: none given).
pub fn parse_reference(reference: &str) -> Result<(&str, Option<&str>)> {
    let (path, tag) = match reference.split_once(':') {
        Some((p, t)) => (p, Some(t)),
        None => (reference, None),
    };
    let name = path.rsplit('/').next().unwrap_or(path);
    if path.split('/').count() > 2 || !path.split('/').all(valid_name) {
        return Err(Error::BadRequest(format!(
            "'{reference}' is not a template reference ([team/]name[:tag])"
        )));
    }
    if let Some(t) = tag {
        check_tag(t)?;
    }
    Ok((name, tag))
}

/// Whether `tag` may be a tag: a name's characters (a build id is one too).
pub fn check_tag(tag: &str) -> Result<()> {
    if valid_name(tag) {
        Ok(())
    } else {
        Err(Error::BadRequest(format!(
            "'{tag}' is not a tag (letters, digits, '-', '_', '.')"
        )))
    }
}

/// The directory name of build `build_id` of template `name` (one made with tags).
pub fn build_dir_name(name: &str, build_id: &str) -> String {
    format!("{name}@{build_id}")
}

/// The template a build's directory name belongs to (`name@id` → `name`).
pub fn template_of(build: &str) -> &str {
    build.split_once('@').map_or(build, |(n, _)| n)
}

impl TemplateStore {
    fn tags_dir(&self) -> PathBuf {
        self.root.join(".tags")
    }

    fn tag_file_path(&self, name: &str) -> Result<PathBuf> {
        if !valid_name(name) {
            return Err(Error::BadRequest(format!(
                "'{name}' is not a template name"
            )));
        }
        Ok(self.tags_dir().join(format!("{name}.json")))
    }

    /// The tags of template `name`: its file, or `default` on its own directory when it
    /// has none (and nothing when that is not built either).
    pub fn tags(&self, name: &str) -> Result<TagFile> {
        if let Some(f) = self.tag_file(name)? {
            return Ok(f);
        }
        let mut f = TagFile::default();
        if let Ok(t) = self.get(name) {
            f.tags.insert(
                DEFAULT_TAG.to_string(),
                Tagged {
                    build: name.to_string(),
                    created_ms: t.created_ms,
                },
            );
        }
        Ok(f)
    }

    /// The tags file of `name`, if it has one.
    fn tag_file(&self, name: &str) -> Result<Option<TagFile>> {
        let path = self.tag_file_path(name)?;
        match std::fs::read_to_string(&path) {
            Ok(text) => serde_json::from_str(&text)
                .map(Some)
                .map_err(|e| Error::TemplateBroken {
                    name: name.to_string(),
                    why: format!("{}: {e}", path.display()),
                }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::io("reading", &path)(e)),
        }
    }

    /// Changes the tags of `name` with `f`, under the lock, and writes them back.
    fn change_tags<T>(&self, name: &str, f: impl FnOnce(&mut TagFile) -> Result<T>) -> Result<T> {
        let path = self.tag_file_path(name)?;
        let dir = self.tags_dir();
        std::fs::create_dir_all(&dir).map_err(Error::io("creating", &dir))?;
        let lock_path = dir.join(format!("{name}.lock"));
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(Error::io("opening", &lock_path))?;
        lock.lock().map_err(Error::io("locking", &lock_path))?;
        let mut file = self.tags(name)?;
        let out = f(&mut file)?;
        let tmp = dir.join(format!(".{name}.{}.tmp", crate::ids::random_string(8)));
        let text =
            serde_json::to_string_pretty(&file).map_err(|e| Error::Corrupt(e.to_string()))?;
        let written = std::fs::write(&tmp, text)
            .map_err(Error::io("writing", &tmp))
            .and_then(|()| std::fs::rename(&tmp, &path).map_err(Error::io("renaming", &tmp)));
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        written.map(|()| out)
    }

    /// The builds of template `name` that are complete: its own directory and each
    /// `name@<id>`, by directory name.
    pub fn builds(&self, name: &str) -> Result<Vec<String>> {
        let prefix = format!("{name}@");
        Ok(self
            .list()?
            .into_iter()
            .map(|t| t.name)
            .filter(|n| n == name || n.starts_with(&prefix))
            .collect())
    }

    /// The build directory `reference` (`name`, `name:tag` or `name:<build id>`) means.
    /// On the path of every create: the tags file is read (when there is one), nothing
    /// else; the caller reads the build's `template.json` (absent: not found).
    pub fn resolve(&self, reference: &str) -> Result<String> {
        let (name, tag) = parse_reference(reference)?;
        let tag = tag.unwrap_or(DEFAULT_TAG);
        match self.tag_file(name)? {
            Some(f) => {
                if let Some(t) = f.tags.get(tag) {
                    return Ok(t.build.clone());
                }
            }
            // No tags file: `default` is the template's own directory.
            None if tag == DEFAULT_TAG => return Ok(name.to_string()),
            None => {}
        }
        // A build id: a build kept beside the template, or the template's own.
        let kept = build_dir_name(name, tag);
        if crate::template::is_build_id(tag) && self.get(&kept).is_ok() {
            return Ok(kept);
        }
        if self.get(name).is_ok_and(|t| t.build_id() == tag) {
            return Ok(name.to_string());
        }
        Err(Error::TemplateNotFound(format!("{name}:{tag}")))
    }

    /// Puts `tags` on the build `target` (`name:tag` or `name:<build id>`; `name` alone:
    /// its default) means. Returns that build's id.
    pub fn assign_tags(&self, target: &str, tags: &[String]) -> Result<String> {
        let (name, _) = parse_reference(target)?;
        if tags.is_empty() {
            return Err(Error::BadRequest("no tags to assign".into()));
        }
        tags.iter().try_for_each(|t| check_tag(t))?;
        let build = self.resolve(target)?;
        let id = self.get(&build)?.build_id();
        self.change_tags(name, |f| put_tags(f, name, &build, tags))?;
        Ok(id)
    }

    /// Records a finished build `build` of `name` under `tags`.
    pub fn tag_build(&self, name: &str, build: &str, tags: &[String]) -> Result<()> {
        self.change_tags(name, |f| put_tags(f, name, build, tags))
    }

    /// Takes `tags` off template `name` (a tag it does not have is no error; `default`
    /// cannot be taken off).
    pub fn remove_tags(&self, name: &str, tags: &[String]) -> Result<()> {
        if tags.iter().any(|t| t == DEFAULT_TAG) {
            return Err(Error::BadRequest(format!(
                "the tag '{DEFAULT_TAG}' cannot be removed (assign it to another build instead)"
            )));
        }
        if self.builds(name)?.is_empty() {
            return Err(Error::NotFound(format!("template {name}")));
        }
        self.change_tags(name, |f| {
            for t in tags {
                f.tags.remove(t);
            }
            Ok(())
        })
    }

    /// The tags of `name` (a name or `name:tag`), with their builds' ids.
    pub fn list_tags(&self, reference: &str) -> Result<Vec<TagInfo>> {
        let (name, _) = parse_reference(reference)?;
        let f = self.tags(name)?;
        if f.tags.is_empty() && self.builds(name)?.is_empty() {
            return Err(Error::NotFound(format!("template {name}")));
        }
        f.tags
            .iter()
            .map(|(tag, t)| {
                Ok(TagInfo {
                    tag: tag.clone(),
                    build_id: self.get(&t.build)?.build_id(),
                    created_ms: t.created_ms,
                })
            })
            .collect()
    }

    /// Sets E2B's `public` flag of `name`; returns its names (`name:tag` for each tag).
    pub fn set_public(&self, name: &str, public: bool) -> Result<Vec<String>> {
        if self.builds(name)?.is_empty() {
            return Err(Error::NotFound(format!("template {name}")));
        }
        self.change_tags(name, |f| {
            f.public = public;
            Ok(f.tags.keys().map(|t| format!("{name}:{t}")).collect())
        })
    }

    /// The builds of `name` no tag means (what may go once no sandbox uses them).
    pub fn untagged_builds(&self, name: &str) -> Result<Vec<String>> {
        let f = self.tags(name)?;
        Ok(self
            .builds(name)?
            .into_iter()
            .filter(|b| !f.tags.values().any(|t| &t.build == b))
            .collect())
    }

    /// Removes the tags file of `name` (its builds are gone).
    pub fn forget_tags(&self, name: &str) -> Result<()> {
        let path = self.tag_file_path(name)?;
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(Error::io("removing", &path)(e))
            }
            _ => Ok(()),
        }
    }
}

fn put_tags(f: &mut TagFile, name: &str, build: &str, tags: &[String]) -> Result<()> {
    let now = crate::ids::now_ms();
    let new = tags.iter().filter(|t| !f.tags.contains_key(*t)).count();
    if f.tags.len() + new > MAX_TAGS {
        return Err(Error::BadRequest(format!(
            "template {name} would have more than {MAX_TAGS} tags"
        )));
    }
    for t in tags {
        f.tags.insert(
            t.clone(),
            Tagged {
                build: build.to_string(),
                created_ms: now,
            },
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::template::{new_build_id, Template};

    fn store(name: &str) -> (PathBuf, TemplateStore) {
        let d = std::env::temp_dir().join(format!("sandbox-tags-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let s = TemplateStore::new(&d);
        (d, s)
    }

    fn built(s: &TemplateStore, dir: &str, build_id: Option<String>) {
        s.prepare(dir, true).unwrap();
        s.finish(&Template {
            name: dir.into(),
            vcpus: 1,
            mem_mib: 64,
            disk: false,
            test_guest: true,
            created_ms: 7,
            setup: vec![],
            net: false,
            image: None,
            boot: None,
            build_id,
        })
        .unwrap();
    }

    fn tags(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_template_without_tags_has_default_on_its_own_directory() {
        let (d, s) = store("legacy");
        assert!(matches!(
            s.resolve("a").and_then(|b| s.get(&b)),
            Err(Error::TemplateNotFound(_))
        ));
        built(&s, "a", None);
        assert_eq!(s.resolve("a").unwrap(), "a");
        assert_eq!(s.resolve("a:default").unwrap(), "a");
        assert_eq!(s.resolve("team/a").unwrap(), "a");
        assert!(matches!(s.resolve("a:v1"), Err(Error::TemplateNotFound(_))));
        // Its derived build id means it too, and stays the same.
        let id = s.get("a").unwrap().build_id();
        assert!(crate::template::is_build_id(&id), "{id}");
        assert_eq!(s.get("a").unwrap().build_id(), id);
        assert_eq!(s.resolve(&format!("a:{id}")).unwrap(), "a");
        let l = s.list_tags("a").unwrap();
        assert_eq!(l.len(), 1);
        assert_eq!(
            (l[0].tag.as_str(), l[0].build_id.as_str()),
            ("default", id.as_str())
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn tags_move_between_builds_and_default_stays() {
        let (d, s) = store("move");
        built(&s, "a", None);
        let b2 = new_build_id().unwrap();
        let dir2 = build_dir_name("a", &b2);
        built(&s, &dir2, Some(b2.clone()));
        s.tag_build("a", &dir2, &tags(&["v2"])).unwrap();
        assert_eq!(s.resolve("a").unwrap(), "a");
        assert_eq!(s.resolve("a:v2").unwrap(), dir2);
        assert_eq!(s.resolve(&format!("a:{b2}")).unwrap(), dir2);
        // Tagging from a tag: the same build.
        assert_eq!(
            s.assign_tags("a:v2", &tags(&["stable", "prod"])).unwrap(),
            b2
        );
        assert_eq!(s.resolve("a:prod").unwrap(), dir2);
        let listed: Vec<String> = s
            .list_tags("a")
            .unwrap()
            .into_iter()
            .map(|t| t.tag)
            .collect();
        assert_eq!(listed, tags(&["default", "prod", "stable", "v2"]));
        assert!(s.untagged_builds("a").unwrap().is_empty());
        // Default moves: the template's own directory is then meant by no tag.
        s.assign_tags("a:v2", &tags(&["default"])).unwrap();
        assert_eq!(s.resolve("a").unwrap(), dir2);
        assert_eq!(s.untagged_builds("a").unwrap(), tags(&["a"]));
        // Removing: default refused, an absent tag no error, the rest gone.
        assert!(matches!(
            s.remove_tags("a", &tags(&["default"])),
            Err(Error::BadRequest(_))
        ));
        s.remove_tags("a", &tags(&["prod", "never-there"])).unwrap();
        assert!(matches!(
            s.resolve("a:prod"),
            Err(Error::TemplateNotFound(_))
        ));
        assert!(matches!(
            s.remove_tags("nope", &tags(&["x"])),
            Err(Error::NotFound(_))
        ));
        // Public is recorded; names list every tag.
        assert_eq!(
            s.set_public("a", true).unwrap(),
            tags(&["a:default", "a:stable", "a:v2"])
        );
        assert!(s.tags("a").unwrap().public);
        // Removing the template removes every build and its tags.
        s.remove("a", 0).unwrap();
        assert!(s.builds("a").unwrap().is_empty());
        assert!(s.tags("a").unwrap().tags.is_empty());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn bad_references_and_too_many_tags_are_refused() {
        let (d, s) = store("bad");
        built(&s, "a", None);
        for r in ["", "a:", "a:b:c", "../a", "a/b/c", "a:../x", "a@x", ":x"] {
            assert!(s.resolve(r).is_err(), "{r}");
        }
        assert!(matches!(
            s.assign_tags("a", &tags(&["ok", "no/slash"])),
            Err(Error::BadRequest(_))
        ));
        assert!(matches!(s.assign_tags("a", &[]), Err(Error::BadRequest(_))));
        let many: Vec<String> = (0..MAX_TAGS).map(|i| format!("t{i}")).collect();
        assert!(matches!(
            s.assign_tags("a", &many),
            Err(Error::BadRequest(_))
        ));
        s.assign_tags("a", &many[..MAX_TAGS - 1]).unwrap();
        // A build's directory name is a template directory; other '@' names are not.
        assert!(crate::template::valid_dir_name(&build_dir_name(
            "a",
            &new_build_id().unwrap()
        )));
        assert!(!crate::template::valid_dir_name("a@1234"));
        assert!(!crate::template::valid_dir_name("a@b@c"));
        std::fs::remove_dir_all(&d).unwrap();
    }
}
