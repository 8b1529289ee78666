//! A `json`-protocol worker's response, checked whole before anything is published: the
//! response object, every content block against the MCP `ContentBlock` schema, the state.
//!
//! The rules are a closed allow-list (unknown keys are refused, not ignored), stricter than
//! what rmcp's `CallToolResult` accepts; the property tests in `exec::proptests` check that
//! whatever passes here always becomes a `CallToolResult`, so a committed call can never be
//! answered with a JSON-RPC error instead of its result.

use serde_json::{Map, Value};

use super::args::kind;
use crate::policy::redact::Secrets;

/// A well-formed response.
#[derive(Debug, Clone, PartialEq)]
pub struct Response {
    /// MCP content blocks, each checked.
    pub content: Vec<Value>,
    /// The new session state, if the worker returned one.
    pub state: Option<Map<String, Value>>,
    /// The worker reported a fault: nothing is published.
    pub is_error: bool,
}

/// What is wrong with a response; the message names the key or the block.
#[derive(Debug, thiserror::Error)]
pub enum ResponseError {
    #[error("not one JSON value")]
    NotJson(#[source] serde_json::Error),
    #[error("not a JSON object but {0}")]
    NotObject(&'static str),
    #[error(
        "unknown key {0} (a response holds \"content\", \"state\" and \"isError\"; \
         airlock sets structuredContent itself)"
    )]
    UnknownKey(String),
    #[error("\"{key}\" must be {expected}, not {found}")]
    WrongType {
        key: &'static str,
        expected: &'static str,
        found: &'static str,
    },
    #[error("content[{index}] is not a valid MCP content block: {reason}")]
    Block { index: usize, reason: BlockError },
}

/// What is wrong with a content block. `what` names the object the fault is in, as a JSON
/// path from the block (`text`, `resource`, `annotations`, `icon 0`); a field's fault is
/// [`BlockError::Field`], its path `what.name`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockError {
    #[error("a block must be an object, not {found}")]
    NotObject { found: &'static str },
    #[error("\"type\" must be a string, not {found}")]
    TypeNotString { found: &'static str },
    #[error("it has no \"type\"")]
    NoType,
    /// `shown`: the type as a message shows a worker's string (scrubbed, cut).
    #[error("unknown type {shown} (MCP content is text, image, audio, resource_link or resource)")]
    UnknownType { shown: String },
    /// `shown`: the key as a message shows a worker's string.
    #[error("{what} has unknown key {shown}")]
    UnknownKey { what: String, shown: String },
    #[error("{what} has no \"{name}\"")]
    Missing { what: String, name: &'static str },
    /// The field `name` of `what` is not of its shape.
    #[error("{what}.{name}: {fault}")]
    Field {
        what: String,
        name: &'static str,
        fault: Box<FieldFault>,
    },
}

/// Why a field's value is not of its shape.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FieldFault {
    #[error("must be {expected}, not {found}")]
    WrongType {
        expected: &'static str,
        found: &'static str,
    },
    #[error("is not base64: {0}")]
    NotBase64(Base64Fault),
    #[error("audience must be an array, not {found}")]
    AudienceNotArray { found: &'static str },
    #[error("audience may hold only \"user\" and \"assistant\"")]
    AudienceRole,
    #[error("priority must be a number from 0 to 1")]
    Priority,
    #[error("[{index}] must be an object, not {found}")]
    IconNotObject { index: usize, found: &'static str },
    #[error("icon {index}: sizes must be an array of strings")]
    IconSizes { index: usize },
    #[error("icon {index}: theme must be \"light\" or \"dark\"")]
    IconTheme { index: usize },
    #[error("a resource holds exactly one of \"text\" and \"blob\"")]
    ResourceBody,
    /// A fault of an object the field holds (its annotations, an icon, a resource).
    #[error(transparent)]
    Inner(BlockError),
}

impl From<BlockError> for FieldFault {
    fn from(e: BlockError) -> Self {
        FieldFault::Inner(e)
    }
}

/// Why a string is not standard padded base64.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Base64Fault {
    #[error("its length {len} is not a multiple of 4")]
    Length { len: usize },
    #[error("more than two '=' of padding")]
    Padding,
    #[error("byte {at} is {byte:?}")]
    Byte { at: usize, byte: char },
}

/// Parses and checks a worker's whole stdout. A string of it an error quotes is shown as
/// [`Secrets::shown`] does: scrubbed of the call's `secrets` before it is cut.
pub fn parse(stdout: &str, secrets: &Secrets) -> Result<Response, ResponseError> {
    let v: Value = serde_json::from_str(stdout.trim()).map_err(ResponseError::NotJson)?;
    check(v, secrets)
}

/// Checks a response already read as JSON (a `python` tool's, from its runner's reply).
pub fn check(v: Value, secrets: &Secrets) -> Result<Response, ResponseError> {
    let Value::Object(obj) = v else {
        return Err(ResponseError::NotObject(kind(&v)));
    };
    if let Some(k) = obj
        .keys()
        .find(|k| !matches!(k.as_str(), "content" | "state" | "isError"))
    {
        return Err(ResponseError::UnknownKey(secrets.shown(k)));
    }
    let content = match obj.get("content") {
        None => Vec::new(),
        Some(Value::Array(a)) => a.clone(),
        Some(other) => {
            return Err(ResponseError::WrongType {
                key: "content",
                expected: "an array of content blocks",
                found: kind(other),
            })
        }
    };
    for (index, block) in content.iter().enumerate() {
        check_block(block, secrets).map_err(|reason| ResponseError::Block { index, reason })?;
    }
    let is_error = match obj.get("isError") {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(other) => {
            return Err(ResponseError::WrongType {
                key: "isError",
                expected: "a boolean",
                found: kind(other),
            })
        }
    };
    let state = match obj.get("state") {
        None | Some(Value::Null) => None,
        Some(Value::Object(m)) => Some(m.clone()),
        Some(other) => {
            return Err(ResponseError::WrongType {
                key: "state",
                expected: "an object",
                found: kind(other),
            })
        }
    };
    Ok(Response {
        content,
        state,
        is_error,
    })
}

/// Fields of an object: each name with the shape its value must have.
type Fields<'a> = &'a [(&'static str, Shape)];

/// The shape a field must have.
#[derive(Clone, Copy)]
enum Shape {
    Str,
    Base64,
    Size,
    Object,
    Annotations,
    Icons,
    Resource,
}

/// Checks one content block: `text`, `image`, `audio`, `resource_link` or `resource`, with
/// its required fields, its optional ones, and nothing else.
pub fn check_block(block: &Value, secrets: &Secrets) -> Result<(), BlockError> {
    use Shape::*;
    let Value::Object(o) = block else {
        return Err(BlockError::NotObject { found: kind(block) });
    };
    let ty = match o.get("type") {
        Some(Value::String(t)) => t.as_str(),
        Some(other) => return Err(BlockError::TypeNotString { found: kind(other) }),
        None => return Err(BlockError::NoType),
    };
    let (required, optional): (Fields, Fields) = match ty {
        "text" => (&[("text", Str)], &[]),
        "image" | "audio" => (&[("data", Base64), ("mimeType", Str)], &[]),
        "resource_link" => (
            &[("uri", Str), ("name", Str)],
            &[
                ("title", Str),
                ("description", Str),
                ("mimeType", Str),
                ("size", Size),
                ("icons", Icons),
            ],
        ),
        "resource" => (&[("resource", Resource)], &[]),
        other => {
            return Err(BlockError::UnknownType {
                shown: secrets.shown(other),
            })
        }
    };
    let common: Fields = &[("annotations", Annotations), ("_meta", Object)];
    fields(
        o,
        ty,
        required,
        &[optional, common].concat(),
        &["type"],
        secrets,
    )
}

/// Checks an object's fields: each of `required` present, each of `optional` present or not,
/// every one of its shape, and no key outside those and `ignored`.
fn fields(
    o: &Map<String, Value>,
    what: &str,
    required: Fields,
    optional: Fields,
    ignored: &[&str],
    secrets: &Secrets,
) -> Result<(), BlockError> {
    for k in o.keys() {
        let known = ignored.contains(&k.as_str())
            || required.iter().chain(optional).any(|(name, _)| name == k);
        if !known {
            return Err(BlockError::UnknownKey {
                what: what.to_string(),
                shown: secrets.shown(k),
            });
        }
    }
    let field = |name: &'static str, fault: FieldFault| BlockError::Field {
        what: what.to_string(),
        name,
        fault: Box::new(fault),
    };
    for &(name, shape) in required {
        let v = o.get(name).ok_or_else(|| BlockError::Missing {
            what: what.to_string(),
            name,
        })?;
        check_shape(v, shape, secrets).map_err(|e| field(name, e))?;
    }
    for &(name, shape) in optional {
        if let Some(v) = o.get(name) {
            check_shape(v, shape, secrets).map_err(|e| field(name, e))?;
        }
    }
    Ok(())
}

fn check_shape(v: &Value, shape: Shape, secrets: &Secrets) -> Result<(), FieldFault> {
    use Shape::*;
    let want = |expected: &'static str| FieldFault::WrongType {
        expected,
        found: kind(v),
    };
    match shape {
        Str => v.as_str().map(|_| ()).ok_or_else(|| want("a string")),
        Base64 => match v.as_str() {
            Some(s) => check_base64(s).map_err(FieldFault::NotBase64),
            None => Err(want("a base64 string")),
        },
        Size => v
            .as_u64()
            .map(|_| ())
            .ok_or_else(|| want("a non-negative integer")),
        Object => v.as_object().map(|_| ()).ok_or_else(|| want("an object")),
        Annotations => {
            let o = v.as_object().ok_or_else(|| want("an object"))?;
            fields(
                o,
                "annotations",
                &[],
                &[("lastModified", Str)],
                &["audience", "priority"],
                secrets,
            )?;
            if let Some(a) = o.get("audience") {
                let roles = a
                    .as_array()
                    .ok_or_else(|| FieldFault::AudienceNotArray { found: kind(a) })?;
                if !roles
                    .iter()
                    .all(|r| matches!(r.as_str(), Some("user" | "assistant")))
                {
                    return Err(FieldFault::AudienceRole);
                }
            }
            if let Some(p) = o.get("priority") {
                match p.as_f64() {
                    Some(x) if (0.0..=1.0).contains(&x) => {}
                    _ => return Err(FieldFault::Priority),
                }
            }
            Ok(())
        }
        Icons => {
            let icons = v.as_array().ok_or_else(|| want("an array"))?;
            for (i, icon) in icons.iter().enumerate() {
                let o = icon.as_object().ok_or_else(|| FieldFault::IconNotObject {
                    index: i,
                    found: kind(icon),
                })?;
                let what = format!("icon {i}");
                fields(
                    o,
                    &what,
                    &[("src", Str)],
                    &[("mimeType", Str)],
                    &["sizes", "theme"],
                    secrets,
                )?;
                if let Some(s) = o.get("sizes") {
                    if !s.as_array().is_some_and(|a| a.iter().all(Value::is_string)) {
                        return Err(FieldFault::IconSizes { index: i });
                    }
                }
                if let Some(t) = o.get("theme") {
                    if !matches!(t.as_str(), Some("light" | "dark")) {
                        return Err(FieldFault::IconTheme { index: i });
                    }
                }
            }
            Ok(())
        }
        Resource => {
            let o = v.as_object().ok_or_else(|| want("an object"))?;
            let (body, shape) = match (o.contains_key("text"), o.contains_key("blob")) {
                (true, false) => ("text", Str),
                (false, true) => ("blob", Base64),
                _ => return Err(FieldFault::ResourceBody),
            };
            fields(
                o,
                "resource",
                &[("uri", Str), (body, shape)],
                &[("mimeType", Str), ("_meta", Object)],
                &[],
                secrets,
            )?;
            Ok(())
        }
    }
}

/// Standard base64 (RFC 4648 section 4) with padding, as MCP's `data` and `blob` are.
fn check_base64(s: &str) -> Result<(), Base64Fault> {
    let b = s.as_bytes();
    if b.len() % 4 != 0 {
        return Err(Base64Fault::Length { len: b.len() });
    }
    let pad = b.iter().rev().take_while(|&&c| c == b'=').count();
    if pad > 2 {
        return Err(Base64Fault::Padding);
    }
    let body = &b[..b.len() - pad];
    if let Some(at) = body
        .iter()
        .position(|c| !(c.is_ascii_alphanumeric() || *c == b'+' || *c == b'/'))
    {
        return Err(Base64Fault::Byte {
            at,
            byte: char::from(body[at]),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn every_mcp_block_type_passes() {
        let ok = [
            json!({"type": "text", "text": "hi"}),
            json!({"type": "text", "text": "", "annotations": {"audience": ["user"], "priority": 0.5, "lastModified": "2025-01-01T00:00:00Z"}, "_meta": {"k": 1}}),
            json!({"type": "image", "data": "aGk=", "mimeType": "image/png"}),
            json!({"type": "audio", "data": "", "mimeType": "audio/wav"}),
            json!({"type": "resource_link", "uri": "file:///a", "name": "a", "size": 3, "icons": [{"src": "data:x", "sizes": ["48x48"], "theme": "dark"}]}),
            json!({"type": "resource", "resource": {"uri": "file:///a", "text": "x", "mimeType": "text/plain"}}),
            json!({"type": "resource", "resource": {"uri": "file:///a", "blob": "AAEC"}}),
        ];
        for b in &ok {
            assert_eq!(check_block(b, &Secrets::default()), Ok(()), "{b}");
        }
    }

    #[test]
    fn bad_blocks_are_named() {
        let bad = [
            (json!("text"), "must be an object"),
            (json!({"text": "x"}), "no \"type\""),
            (json!({"type": "txt", "text": "x"}), "unknown type \"txt\""),
            (json!({"type": "text"}), "text has no \"text\""),
            (
                json!({"type": "text", "text": 5}),
                "text.text: must be a string",
            ),
            (
                json!({"type": "text", "text": "x", "extra": 1}),
                "unknown key \"extra\"",
            ),
            (
                json!({"type": "image", "data": "not base64!", "mimeType": "image/png"}),
                "is not base64",
            ),
            (json!({"type": "image", "data": "aGk="}), "no \"mimeType\""),
            (
                json!({"type": "resource_link", "uri": "u", "name": "n", "size": -1}),
                "non-negative integer",
            ),
            (
                json!({"type": "resource", "resource": {"uri": "u"}}),
                "exactly one of",
            ),
            (
                json!({"type": "resource", "resource": {"uri": "u", "text": "t", "blob": "AA=="}}),
                "exactly one of",
            ),
            (
                json!({"type": "text", "text": "x", "annotations": {"priority": 2}}),
                "priority",
            ),
            (
                json!({"type": "text", "text": "x", "annotations": {"audience": ["root"]}}),
                "audience",
            ),
        ];
        for (b, needle) in &bad {
            let e = check_block(b, &Secrets::default())
                .expect_err(&b.to_string())
                .to_string();
            assert!(e.contains(needle), "{b}: {e:?} does not say {needle:?}");
        }
    }

    #[test]
    fn responses_are_checked_whole() {
        let r = parse(
            r#"{"content":[{"type":"text","text":"hi"}],"state":{"n":1}}"#,
            &Secrets::default(),
        )
        .unwrap();
        assert!(!r.is_error);
        assert_eq!(r.state.unwrap()["n"], 1);
        assert!(matches!(
            parse("not json", &Secrets::default()),
            Err(ResponseError::NotJson(_))
        ));
        assert!(matches!(
            parse("[]", &Secrets::default()),
            Err(ResponseError::NotObject(_))
        ));
        assert!(matches!(
            parse(r#"{"state": 3}"#, &Secrets::default()),
            Err(ResponseError::WrongType { key: "state", .. })
        ));
        assert!(matches!(
            parse(r#"{"isError": "yes"}"#, &Secrets::default()),
            Err(ResponseError::WrongType { key: "isError", .. })
        ));
        assert!(matches!(
            parse(r#"{"structuredContent": {}}"#, &Secrets::default()),
            Err(ResponseError::UnknownKey(_))
        ));
        let e = parse(
            r#"{"content":[{"type":"text","text":"a"},{"type":"bogus"}],"state":{}}"#,
            &Secrets::default(),
        )
        .unwrap_err();
        assert!(
            matches!(&e, ResponseError::Block { index: 1, reason: BlockError::UnknownType { shown } } if shown == "\"bogus\""),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            "content[1] is not a valid MCP content block: unknown type \"bogus\" (MCP content is text, image, audio, resource_link or resource)"
        );
        // A fault's content is checked too: it reaches the client as well.
        assert!(matches!(
            parse(
                r#"{"isError": true, "content": [{"type": "text"}]}"#,
                &Secrets::default()
            ),
            Err(ResponseError::Block { index: 0, .. })
        ));
    }
}
