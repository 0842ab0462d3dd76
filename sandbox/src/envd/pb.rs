//! The messages of E2B's envd services (`process.Process`, `filesystem.Filesystem`), written
//! by hand with `prost` derives instead of generated (no `protoc` at build time).
//!
//! Field numbers, types and names follow envd's `process/process.proto` and
//! `filesystem/filesystem.proto` as the pinned SDK (`e2b==2.63.0`) embeds them in its
//! generated `process_pb.py` / `filesystem_pb.py` (the serialized descriptors there are the
//! reference). Only what the data plane serves is here.
//!
//! Each message is also (de)serializable as proto3 JSON (`serde`), because the SDK speaks
//! the Connect JSON codec: lowerCamelCase names, `bytes` as base64, 64-bit integers as
//! strings, enums by name, a oneof as the field of its set member, `Timestamp` as RFC 3339.
//! Unknown fields are ignored on input, as proto3 JSON parsers do.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// `bytes` as base64 (standard alphabet, padded on output; URL-safe and unpadded accepted).
pub(crate) mod b64 {
    use base64::engine::general_purpose::{STANDARD, URL_SAFE};
    use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
    use base64::Engine;
    use serde::{Deserialize, Deserializer, Serializer};

    const LENIENT: GeneralPurposeConfig =
        GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent);

    pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&STANDARD.encode(v))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s = Option::<String>::deserialize(d)?.unwrap_or_default();
        let std_ = GeneralPurpose::new(&base64::alphabet::STANDARD, LENIENT);
        let url = GeneralPurpose::new(&base64::alphabet::URL_SAFE, LENIENT);
        std_.decode(&s)
            .or_else(|_| url.decode(&s))
            .or_else(|_| URL_SAFE.decode(&s))
            .map_err(|e| serde::de::Error::custom(format!("invalid base64: {e}")))
    }
}

/// `int64` as a JSON string (numbers accepted on input).
mod i64_str {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &i64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&v.to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum N {
            S(String),
            I(i64),
        }
        match Option::<N>::deserialize(d)? {
            None => Ok(0),
            Some(N::I(i)) => Ok(i),
            Some(N::S(s)) => s.parse().map_err(serde::de::Error::custom),
        }
    }
}

/// An enum field (stored as `i32` like prost does) as its proto name; names or numbers
/// accepted on input.
macro_rules! enum_json {
    ($modname:ident, $ty:ty) => {
        mod $modname {
            use serde::{Deserialize, Deserializer, Serializer};

            pub fn serialize<S: Serializer>(v: &i32, s: S) -> Result<S::Ok, S::Error> {
                match <$ty>::try_from(*v) {
                    Ok(e) => s.serialize_str(e.as_str_name()),
                    Err(_) => s.serialize_i32(*v),
                }
            }

            pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<i32, D::Error> {
                #[derive(Deserialize)]
                #[serde(untagged)]
                enum N {
                    S(String),
                    I(i32),
                }
                match Option::<N>::deserialize(d)? {
                    None => Ok(0),
                    Some(N::I(i)) => Ok(i),
                    Some(N::S(s)) => <$ty>::from_str_name(&s)
                        .map(|e| e as i32)
                        .ok_or_else(|| serde::de::Error::custom(format!("unknown enum value {s}"))),
                }
            }
        }
    };
}

enum_json!(signal_json, super::Signal);
enum_json!(file_type_json, super::FileType);
enum_json!(event_type_json, super::EventType);

/// `google.protobuf.Timestamp`; JSON: RFC 3339 in UTC.
#[derive(Clone, Copy, PartialEq, Eq, prost::Message)]
pub struct Timestamp {
    #[prost(int64, tag = "1")]
    pub seconds: i64,
    #[prost(int32, tag = "2")]
    pub nanos: i32,
}

impl Serialize for Timestamp {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let t = chrono::DateTime::from_timestamp(self.seconds, self.nanos.max(0) as u32)
            .unwrap_or_default();
        s.serialize_str(&t.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true))
    }
}

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let t = chrono::DateTime::parse_from_rfc3339(&s).map_err(serde::de::Error::custom)?;
        Ok(Timestamp {
            seconds: t.timestamp(),
            nanos: t.timestamp_subsec_nanos() as i32,
        })
    }
}

// ------------------------------------------------------------------------- process

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum Signal {
    Unspecified = 0,
    Sigterm = 15,
    Sigkill = 9,
}

impl Signal {
    pub fn as_str_name(&self) -> &'static str {
        match self {
            Signal::Unspecified => "SIGNAL_UNSPECIFIED",
            Signal::Sigterm => "SIGNAL_SIGTERM",
            Signal::Sigkill => "SIGNAL_SIGKILL",
        }
    }

    pub fn from_str_name(s: &str) -> Option<Self> {
        match s {
            "SIGNAL_UNSPECIFIED" => Some(Signal::Unspecified),
            "SIGNAL_SIGTERM" => Some(Signal::Sigterm),
            "SIGNAL_SIGKILL" => Some(Signal::Sigkill),
            _ => None,
        }
    }
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct PtySize {
    #[prost(uint32, tag = "1")]
    pub cols: u32,
    #[prost(uint32, tag = "2")]
    pub rows: u32,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct Pty {
    #[prost(message, optional, tag = "1")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub size: Option<PtySize>,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct ProcessConfig {
    #[prost(string, tag = "1")]
    pub cmd: String,
    #[prost(string, repeated, tag = "2")]
    pub args: Vec<String>,
    #[prost(map = "string, string", tag = "3")]
    pub envs: HashMap<String, String>,
    #[prost(string, optional, tag = "4")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
pub struct ListRequest {}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct ProcessInfo {
    #[prost(message, optional, tag = "1")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub config: Option<ProcessConfig>,
    #[prost(uint32, tag = "2")]
    pub pid: u32,
    #[prost(string, optional, tag = "3")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct ListResponse {
    #[prost(message, repeated, tag = "1")]
    pub processes: Vec<ProcessInfo>,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct StartRequest {
    #[prost(message, optional, tag = "1")]
    pub process: Option<ProcessConfig>,
    #[prost(message, optional, tag = "2")]
    pub pty: Option<Pty>,
    #[prost(string, optional, tag = "3")]
    pub tag: Option<String>,
    #[prost(bool, optional, tag = "4")]
    pub stdin: Option<bool>,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct UpdateRequest {
    #[prost(message, optional, tag = "1")]
    pub process: Option<ProcessSelector>,
    #[prost(message, optional, tag = "2")]
    pub pty: Option<Pty>,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
pub struct Empty {}

pub type UpdateResponse = Empty;
pub type SendInputResponse = Empty;
pub type SendSignalResponse = Empty;
pub type CloseStdinResponse = Empty;
pub type RemoveResponse = Empty;

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StartEvent {
    #[prost(uint32, tag = "1")]
    pub pid: u32,
}

/// `ProcessEvent.DataEvent`: its `output` oneof.
#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
pub struct DataEvent {
    #[prost(oneof = "Output", tags = "1, 2, 3")]
    #[serde(flatten)]
    pub output: Option<Output>,
}

#[derive(Clone, PartialEq, prost::Oneof, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Output {
    #[prost(bytes, tag = "1")]
    Stdout(#[serde(with = "b64")] Vec<u8>),
    #[prost(bytes, tag = "2")]
    Stderr(#[serde(with = "b64")] Vec<u8>),
    #[prost(bytes, tag = "3")]
    Pty(#[serde(with = "b64")] Vec<u8>),
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct EndEvent {
    #[prost(sint32, tag = "1")]
    pub exit_code: i32,
    #[prost(bool, tag = "2")]
    pub exited: bool,
    #[prost(string, tag = "3")]
    pub status: String,
    #[prost(string, optional, tag = "4")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
pub struct ProcessEvent {
    #[prost(oneof = "Event", tags = "1, 2, 3, 4")]
    #[serde(flatten)]
    pub event: Option<Event>,
}

#[derive(Clone, PartialEq, prost::Oneof, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Event {
    #[prost(message, tag = "1")]
    Start(StartEvent),
    #[prost(message, tag = "2")]
    Data(DataEvent),
    #[prost(message, tag = "3")]
    End(EndEvent),
    #[prost(message, tag = "4")]
    Keepalive(Empty),
}

/// `StartResponse` and `ConnectResponse` (same shape).
#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct EventResponse {
    #[prost(message, optional, tag = "1")]
    pub event: Option<ProcessEvent>,
}

impl EventResponse {
    pub fn new(e: Event) -> Self {
        Self {
            event: Some(ProcessEvent { event: Some(e) }),
        }
    }
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
pub struct ProcessInput {
    #[prost(oneof = "Input", tags = "1, 2")]
    #[serde(flatten)]
    pub input: Option<Input>,
}

#[derive(Clone, PartialEq, prost::Oneof, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Input {
    #[prost(bytes, tag = "1")]
    Stdin(#[serde(with = "b64")] Vec<u8>),
    #[prost(bytes, tag = "2")]
    Pty(#[serde(with = "b64")] Vec<u8>),
}

/// `StreamInput`'s messages: a `start` naming the process, then `data` and `keepalive`.
#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct StreamInputRequest {
    #[prost(oneof = "StreamInputEvent", tags = "1, 2, 3")]
    #[serde(flatten)]
    pub event: Option<StreamInputEvent>,
}

#[derive(Clone, PartialEq, prost::Oneof, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum StreamInputEvent {
    #[prost(message, tag = "1")]
    Start(StreamInputStart),
    #[prost(message, tag = "2")]
    Data(StreamInputData),
    #[prost(message, tag = "3")]
    Keepalive(Empty),
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct StreamInputStart {
    #[prost(message, optional, tag = "1")]
    pub process: Option<ProcessSelector>,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct StreamInputData {
    #[prost(message, optional, tag = "2")]
    pub input: Option<ProcessInput>,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct SendInputRequest {
    #[prost(message, optional, tag = "1")]
    pub process: Option<ProcessSelector>,
    #[prost(message, optional, tag = "2")]
    pub input: Option<ProcessInput>,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct SendSignalRequest {
    #[prost(message, optional, tag = "1")]
    pub process: Option<ProcessSelector>,
    #[prost(enumeration = "Signal", tag = "2")]
    #[serde(with = "signal_json")]
    pub signal: i32,
}

/// `CloseStdinRequest` and `ConnectRequest` (same shape).
#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct SelectorRequest {
    #[prost(message, optional, tag = "1")]
    pub process: Option<ProcessSelector>,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
pub struct ProcessSelector {
    #[prost(oneof = "Selector", tags = "1, 2")]
    #[serde(flatten)]
    pub selector: Option<Selector>,
}

#[derive(Clone, PartialEq, prost::Oneof, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Selector {
    #[prost(uint32, tag = "1")]
    Pid(u32),
    #[prost(string, tag = "2")]
    Tag(String),
}

// ---------------------------------------------------------------------- filesystem

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum FileType {
    Unspecified = 0,
    File = 1,
    Directory = 2,
    Symlink = 3,
}

impl FileType {
    pub fn as_str_name(&self) -> &'static str {
        match self {
            FileType::Unspecified => "FILE_TYPE_UNSPECIFIED",
            FileType::File => "FILE_TYPE_FILE",
            FileType::Directory => "FILE_TYPE_DIRECTORY",
            FileType::Symlink => "FILE_TYPE_SYMLINK",
        }
    }

    pub fn from_str_name(s: &str) -> Option<Self> {
        match s {
            "FILE_TYPE_UNSPECIFIED" => Some(FileType::Unspecified),
            "FILE_TYPE_FILE" => Some(FileType::File),
            "FILE_TYPE_DIRECTORY" => Some(FileType::Directory),
            "FILE_TYPE_SYMLINK" => Some(FileType::Symlink),
            _ => None,
        }
    }
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct EntryInfo {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(enumeration = "FileType", tag = "2")]
    #[serde(rename = "type", with = "file_type_json")]
    pub r#type: i32,
    #[prost(string, tag = "3")]
    pub path: String,
    #[prost(int64, tag = "4")]
    #[serde(with = "i64_str")]
    pub size: i64,
    #[prost(uint32, tag = "5")]
    pub mode: u32,
    #[prost(string, tag = "6")]
    pub permissions: String,
    #[prost(string, tag = "7")]
    pub owner: String,
    #[prost(string, tag = "8")]
    pub group: String,
    #[prost(message, optional, tag = "9")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub modified_time: Option<Timestamp>,
    #[prost(string, optional, tag = "10")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub symlink_target: Option<String>,
    #[prost(map = "string, string", tag = "11")]
    #[serde(skip_serializing_if = "HashMap::is_empty")]
    pub metadata: HashMap<String, String>,
    #[prost(bool, tag = "12")]
    pub is_symlink: bool,
}

/// `StatRequest`, `MakeDirRequest`, `RemoveRequest` (one `path`).
#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct PathRequest {
    #[prost(string, tag = "1")]
    pub path: String,
}

/// `StatResponse`, `MakeDirResponse`, `MoveResponse` (one `entry`).
#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct EntryResponse {
    #[prost(message, optional, tag = "1")]
    pub entry: Option<EntryInfo>,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct MoveRequest {
    #[prost(string, tag = "1")]
    pub source: String,
    #[prost(string, tag = "2")]
    pub destination: String,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct ListDirRequest {
    #[prost(string, tag = "1")]
    pub path: String,
    #[prost(uint32, tag = "2")]
    pub depth: u32,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct ListDirResponse {
    #[prost(message, repeated, tag = "1")]
    pub entries: Vec<EntryInfo>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum EventType {
    Unspecified = 0,
    Create = 1,
    Write = 2,
    Remove = 3,
    Rename = 4,
    Chmod = 5,
}

impl EventType {
    pub fn as_str_name(&self) -> &'static str {
        match self {
            EventType::Unspecified => "EVENT_TYPE_UNSPECIFIED",
            EventType::Create => "EVENT_TYPE_CREATE",
            EventType::Write => "EVENT_TYPE_WRITE",
            EventType::Remove => "EVENT_TYPE_REMOVE",
            EventType::Rename => "EVENT_TYPE_RENAME",
            EventType::Chmod => "EVENT_TYPE_CHMOD",
        }
    }

    pub fn from_str_name(s: &str) -> Option<Self> {
        match s {
            "EVENT_TYPE_UNSPECIFIED" => Some(EventType::Unspecified),
            "EVENT_TYPE_CREATE" => Some(EventType::Create),
            "EVENT_TYPE_WRITE" => Some(EventType::Write),
            "EVENT_TYPE_REMOVE" => Some(EventType::Remove),
            "EVENT_TYPE_RENAME" => Some(EventType::Rename),
            "EVENT_TYPE_CHMOD" => Some(EventType::Chmod),
            _ => None,
        }
    }
}

/// `WatchDirRequest` and `CreateWatcherRequest` (same shape).
#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct WatchRequest {
    #[prost(string, tag = "1")]
    pub path: String,
    #[prost(bool, tag = "2")]
    pub recursive: bool,
    #[prost(bool, tag = "3")]
    pub include_entry: bool,
    #[prost(bool, tag = "4")]
    pub allow_network_mounts: bool,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct FilesystemEvent {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(enumeration = "EventType", tag = "2")]
    #[serde(rename = "type", with = "event_type_json")]
    pub r#type: i32,
    #[prost(message, optional, tag = "3")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entry: Option<EntryInfo>,
}

/// `WatchDirResponse`: its `event` oneof.
#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
pub struct WatchDirResponse {
    #[prost(oneof = "WatchDirEvent", tags = "1, 2, 3")]
    #[serde(flatten)]
    pub event: Option<WatchDirEvent>,
}

// Built and encoded one at a time, never stored in bulk: boxing would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, PartialEq, prost::Oneof, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum WatchDirEvent {
    #[prost(message, tag = "1")]
    Start(Empty),
    #[prost(message, tag = "2")]
    Filesystem(FilesystemEvent),
    #[prost(message, tag = "3")]
    Keepalive(Empty),
}

impl WatchDirResponse {
    pub fn new(e: WatchDirEvent) -> Self {
        Self { event: Some(e) }
    }
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct CreateWatcherResponse {
    #[prost(string, tag = "1")]
    pub watcher_id: String,
}

/// `GetWatcherEventsRequest` and `RemoveWatcherRequest` (same shape).
#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct WatcherRequest {
    #[prost(string, tag = "1")]
    pub watcher_id: String,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct GetWatcherEventsResponse {
    #[prost(message, repeated, tag = "1")]
    pub events: Vec<FilesystemEvent>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    #[test]
    fn json_matches_proto3_mapping() {
        let e = EventResponse::new(Event::Data(DataEvent {
            output: Some(Output::Stdout(b"hi\n".to_vec())),
        }));
        assert_eq!(
            serde_json::to_string(&e).unwrap(),
            r#"{"event":{"data":{"stdout":"aGkK"}}}"#
        );
        let end = EventResponse::new(Event::End(EndEvent {
            exit_code: -1,
            exited: false,
            status: "signal: killed".into(),
            error: None,
        }));
        assert_eq!(
            serde_json::to_string(&end).unwrap(),
            r#"{"event":{"end":{"exitCode":-1,"exited":false,"status":"signal: killed"}}}"#
        );
        let r: SendSignalRequest =
            serde_json::from_str(r#"{"process":{"pid":42},"signal":"SIGNAL_SIGKILL"}"#).unwrap();
        assert_eq!(r.signal, 9);
        assert_eq!(
            r.process.unwrap().selector,
            Some(Selector::Pid(42)),
            "oneof member by name"
        );
        let r: StartRequest = serde_json::from_str(
            r#"{"process":{"cmd":"/bin/bash","args":["-l","-c","echo"],"envs":{"A":"b"}},"stdin":false,"unknownField":1}"#,
        )
        .unwrap();
        assert_eq!(r.process.as_ref().unwrap().args.len(), 3);
        assert_eq!(r.stdin, Some(false));
        let i: SendInputRequest =
            serde_json::from_str(r#"{"process":{"tag":"t"},"input":{"stdin":"aGk="}}"#).unwrap();
        assert_eq!(i.input.unwrap().input, Some(Input::Stdin(b"hi".to_vec())));
        // A oneof member that does not decode (bad base64) leaves the oneof unset (serde's
        // flattened Option), which the handlers reject as a missing field.
        let bad: SendInputRequest = serde_json::from_str(r#"{"input":{"stdin":"%%"}}"#).unwrap();
        assert_eq!(bad.input.unwrap().input, None);
        let info = EntryInfo {
            name: "a".into(),
            r#type: FileType::Directory as i32,
            size: 4096,
            modified_time: Some(Timestamp {
                seconds: 1,
                nanos: 5,
            }),
            ..Default::default()
        };
        let v = serde_json::to_value(&info).unwrap();
        assert_eq!(v["type"], "FILE_TYPE_DIRECTORY");
        assert_eq!(v["size"], "4096");
        assert_eq!(v["modifiedTime"], "1970-01-01T00:00:01.000000005Z");
        let back: EntryInfo = serde_json::from_value(v).unwrap();
        assert_eq!(back, info);
    }

    #[test]
    fn binary_matches_sdk_descriptor() {
        // ProcessEvent{start{pid=7}} inside StartResponse: field 1 (event) -> field 1
        // (start) -> field 1 (pid varint).
        let e = EventResponse::new(Event::Start(StartEvent { pid: 7 }));
        assert_eq!(e.encode_to_vec(), vec![0x0a, 0x04, 0x0a, 0x02, 0x08, 0x07]);
        // EndEvent.exit_code is sint32 (zigzag): -1 -> 1.
        let end = EndEvent {
            exit_code: -1,
            ..Default::default()
        };
        assert_eq!(end.encode_to_vec(), vec![0x08, 0x01]);
        // WatchDirResponse{filesystem{name="a", type=WRITE}}: field 2 -> fields 1, 2.
        let w = WatchDirResponse::new(WatchDirEvent::Filesystem(FilesystemEvent {
            name: "a".into(),
            r#type: EventType::Write as i32,
            entry: None,
        }));
        assert_eq!(
            w.encode_to_vec(),
            vec![0x12, 0x05, 0x0a, 0x01, b'a', 0x10, 0x02]
        );
        // The start event is an empty message in field 1.
        let start = WatchDirResponse::new(WatchDirEvent::Start(Empty {}));
        assert_eq!(start.encode_to_vec(), vec![0x0a, 0x00]);
        assert_eq!(
            serde_json::to_string(&w).unwrap(),
            r#"{"filesystem":{"name":"a","type":"EVENT_TYPE_WRITE"}}"#
        );
        let r: WatchRequest =
            serde_json::from_str(r#"{"path":"/x","recursive":true,"includeEntry":false}"#).unwrap();
        assert!(r.recursive && r.path == "/x");
        // A truncated message is an error, never a panic.
        assert!(StartRequest::decode(&[0x0a, 0x10, 0x0a][..]).is_err());
    }
}
