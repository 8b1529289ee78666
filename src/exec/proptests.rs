//! Property tests of the argument rules and of the `json` response check, fed random
//! strings: no panic, substitution in one pass (no placeholder a value brings is expanded),
//! every bound enforced, and every response the check accepts convertible into an MCP
//! `CallToolResult`.

use std::collections::BTreeMap;

use proptest::prelude::*;
use serde_json::{json, Map, Value};

use super::args::{self, ArgError, Piece};
use super::response;

/// Strings rich in what matters here: braces, placeholder-like text, NULs, option dashes,
/// multi-byte characters.
fn tricky() -> impl Strategy<Value = String> {
    proptest::collection::vec(
        prop_oneof![
            Just("{".to_string()),
            Just("}".to_string()),
            Just("{out}".to_string()),
            Just("{session}".to_string()),
            Just("{a}".to_string()),
            Just("{}".to_string()),
            Just("--".to_string()),
            Just("-T-".to_string()),
            Just("\0".to_string()),
            Just("é".to_string()),
            "[a-z_]{0,3}",
            any::<String>(),
        ],
        0..8,
    )
    .prop_map(|v| v.concat())
}

fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("out".to_string()),
        Just("session".to_string()),
        Just("a".to_string()),
        "[a-z_][a-z0-9_]{0,4}"
    ]
}

/// One command element as segments: literal text (no braces) or a placeholder.
#[derive(Debug, Clone)]
enum Seg {
    Lit(String),
    Ph(String),
}

fn template() -> impl Strategy<Value = Vec<Seg>> {
    proptest::collection::vec(
        prop_oneof!["[^{}]{0,6}".prop_map(Seg::Lit), name().prop_map(Seg::Ph),],
        1..5,
    )
}

fn render(t: &[Seg]) -> String {
    t.iter()
        .map(|s| match s {
            Seg::Lit(l) => l.clone(),
            Seg::Ph(n) => format!("{{{n}}}"),
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// A value is copied as data: the element is exactly its template with each placeholder
    /// replaced once, whatever the values hold (`{out}`, `{session}`, braces).
    #[test]
    fn substitution_is_one_pass(
        elements in proptest::collection::vec(template(), 1..4),
        values in proptest::collection::btree_map(name(), tricky(), 0..4),
    ) {
        let command: Vec<String> = elements.iter().map(|t| render(t)).collect();
        let argv = args::substitute(&command, &values);
        let mut expected = Vec::new();
        for t in &elements {
            let only_absent = matches!(
                t.iter().filter(|s| !matches!(s, Seg::Lit(l) if l.is_empty())).collect::<Vec<_>>().as_slice(),
                [Seg::Ph(n)] if !values.contains_key(n)
            );
            if only_absent {
                continue;
            }
            expected.push(
                t.iter()
                    .map(|s| match s {
                        Seg::Lit(l) => l.clone(),
                        Seg::Ph(n) => values.get(n).cloned().unwrap_or_default(),
                    })
                    .collect::<String>(),
            );
        }
        prop_assert_eq!(argv, expected);
    }

    /// Any template at all: no panic, and the scanner agrees with the policy loader.
    #[test]
    fn any_template_scans_as_the_loader_does(part in tricky(), values in proptest::collection::btree_map(name(), tricky(), 0..3)) {
        let names: Vec<&str> = args::pieces(&part)
            .into_iter()
            .filter_map(|p| match p { Piece::Placeholder(n) => Some(n), Piece::Text(_) => None })
            .collect();
        prop_assert_eq!(names, crate::policy::placeholders(&part));
        let rebuilt: String = args::pieces(&part)
            .into_iter()
            .map(|p| match p { Piece::Placeholder(n) => format!("{{{n}}}"), Piece::Text(t) => t.to_string() })
            .collect();
        prop_assert_eq!(&rebuilt, &part);
        let _ = args::substitute(std::slice::from_ref(&part), &values);
    }

    /// What `check_command` accepts fits the kernel: no NUL, each element within
    /// MAX_ARGV_ELEMENT, the whole within the budget; what it refuses names an argument the
    /// command uses.
    #[test]
    fn command_line_bounds_hold(
        sizes in proptest::collection::vec(0usize..200_000, 1..12),
        nul in proptest::option::of(0usize..12),
        env in 0usize..300_000,
        budget in 1usize..2_000_000,
    ) {
        let mut command = vec!["/bin/tool".to_string()];
        let mut values = BTreeMap::new();
        for (i, n) in sizes.iter().enumerate() {
            let name = format!("p{i}");
            command.push(if i % 2 == 0 { format!("{{{name}}}") } else { format!("--{name}={{{name}}}") });
            let mut v = "x".repeat(*n);
            if nul == Some(i) { v.push('\0'); }
            values.insert(name, v);
        }
        match args::check_command("t", &command, &values, env, budget) {
            Ok(()) => {
                let argv = args::substitute(&command, &values);
                let ptr = std::mem::size_of::<usize>();
                let total: usize = argv.iter().map(|a| a.len() + 1 + ptr).sum::<usize>() + ptr + env + ptr;
                prop_assert!(total <= budget);
                for a in &argv {
                    prop_assert!(a.len() < args::MAX_ARGV_ELEMENT);
                    prop_assert!(!a.contains('\0'));
                }
            }
            Err(ArgError::NulByte { name }) | Err(ArgError::TooLong { name, .. }) => {
                prop_assert!(values.contains_key(&name));
            }
            Err(ArgError::ElementTooLong { index, .. }) => prop_assert!(index < command.len()),
            Err(ArgError::CommandLineTooLong { len, limit, .. }) => prop_assert!(len > limit),
            Err(other) => prop_assert!(false, "unexpected {other}"),
        }
    }

    /// Validation of random arguments: no panic; what it accepts is within every bound; what
    /// it refuses says so in a short message (no client string echoed whole).
    #[test]
    fn validation_enforces_bounds(
        session in prop_oneof![tricky(), "[a-zA-Z0-9_-]{1,64}", Just("s".repeat(65))],
        text_len in prop_oneof![0usize..64, Just(args::MAX_STRING_ARG), Just(args::MAX_STRING_ARG + 1)],
        out in prop_oneof![tricky(), Just("o".repeat(args::MAX_PATH_ARG)), Just("o".repeat(args::MAX_PATH_ARG + 1))],
        extra in proptest::option::of(tricky()),
    ) {
        let Some(tool) = shipped("write_text") else {
            return Err(TestCaseError::fail("the shipped policy has no write_text"));
        };
        let mut a = Map::new();
        a.insert("session".into(), Value::String(session.clone()));
        a.insert("text".into(), Value::String("t".repeat(text_len)));
        a.insert("out".into(), Value::String(out.clone()));
        if let Some(k) = &extra {
            a.insert(k.clone(), json!(1));
        }
        match args::validate(tool, &a) {
            Ok(v) => {
                prop_assert!(crate::session::valid_id(&session));
                prop_assert!(text_len <= args::MAX_STRING_ARG);
                prop_assert!(out.len() <= args::MAX_PATH_ARG);
                prop_assert!(!v.contains_key("session"));
            }
            Err(e) => {
                prop_assert!(e.to_string().len() < 600, "{} bytes", e.to_string().len());
                let bad = !crate::session::valid_id(&session)
                    || text_len > args::MAX_STRING_ARG
                    || out.len() > args::MAX_PATH_ARG
                    // An extra key is unknown, or a known one given the integer 1.
                    || extra.is_some();
                prop_assert!(bad, "refused good arguments: {e}");
            }
        }
    }

    /// Session ids: accepted exactly when 1 to 64 ASCII letters, digits, '-' or '_'.
    #[test]
    fn session_ids(id in prop_oneof![tricky(), "[a-zA-Z0-9_-]{0,70}"]) {
        let rule = !id.is_empty() && id.len() <= 64
            && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        match crate::session::check_id(&id) {
            Ok(()) => prop_assert!(rule),
            Err(e) => {
                prop_assert!(!rule);
                prop_assert!(e.to_string().len() < 300);
            }
        }
    }

    /// Random (often nearly valid) responses: no panic; whatever is accepted becomes an MCP
    /// `CallToolResult` as the MCP layer builds it, so a committed call is always answered
    /// with its result.
    #[test]
    fn accepted_responses_always_become_call_tool_results(blocks in proptest::collection::vec(block(), 0..4), is_error in any::<bool>()) {
        let stdout = json!({"content": blocks, "isError": is_error}).to_string();
        if let Ok(r) = response::parse(&stdout, &Default::default()) {
            let v = json!({"content": r.content, "isError": r.is_error, "structuredContent": {"session": "s", "version": 1}});
            let parsed = serde_json::from_value::<rmcp::model::CallToolResult>(v.clone());
            prop_assert!(parsed.is_ok(), "{v}: {:?}", parsed.err());
        }
    }
}

/// A tool of the shipped policy, loaded once.
fn shipped(name: &str) -> Option<&'static crate::policy::Tool> {
    static TOOLS: std::sync::OnceLock<BTreeMap<String, crate::policy::Tool>> =
        std::sync::OnceLock::new();
    TOOLS
        .get_or_init(|| {
            let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("policies");
            crate::policy::load(&dir)
                .map(|p| p.tools)
                .unwrap_or_default()
        })
        .get(name)
}

fn scalar() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        (0.0f64..2.0).prop_map(|f| json!(f)),
        Just(json!("aGk=")),
        Just(json!("user")),
        Just(json!("dark")),
        Just(json!(["user", "assistant"])),
        Just(json!(["48x48"])),
        Just(json!({})),
        Just(json!({"uri": "file:///a", "text": "x"})),
        Just(json!({"uri": "file:///a", "blob": "AA=="})),
        Just(json!([{"src": "data:x"}])),
        tricky().prop_map(Value::String),
    ]
}

fn block() -> impl Strategy<Value = Value> {
    let ty = prop_oneof![
        Just("text"),
        Just("image"),
        Just("audio"),
        Just("resource_link"),
        Just("resource"),
        Just("bogus"),
    ];
    let key = prop_oneof![
        Just("text"),
        Just("data"),
        Just("mimeType"),
        Just("uri"),
        Just("name"),
        Just("title"),
        Just("size"),
        Just("icons"),
        Just("resource"),
        Just("annotations"),
        Just("_meta"),
        Just("extra"),
    ];
    let annotations = prop_oneof![
        Just(json!({"audience": ["user"], "priority": 0.3})),
        Just(json!({"lastModified": "2025-01-01T00:00:00Z"})),
        Just(json!({"priority": 7})),
        Just(json!({"audience": "user"})),
    ];
    (
        ty,
        proptest::collection::vec((key, scalar()), 0..5),
        proptest::option::of(annotations),
    )
        .prop_map(|(ty, fields, annotations)| {
            let mut o = Map::new();
            o.insert("type".into(), json!(ty));
            // A base that is valid for the type, which the random fields then perturb.
            match ty {
                "text" => {
                    o.insert("text".into(), json!("hi"));
                }
                "image" | "audio" => {
                    o.insert("data".into(), json!("aGk="));
                    o.insert("mimeType".into(), json!("x/y"));
                }
                "resource_link" => {
                    o.insert("uri".into(), json!("file:///a"));
                    o.insert("name".into(), json!("a"));
                }
                "resource" => {
                    o.insert("resource".into(), json!({"uri": "u", "text": "t"}));
                }
                _ => {}
            }
            for (k, v) in fields {
                o.insert(k.to_string(), v);
            }
            if let Some(a) = annotations {
                o.insert("annotations".into(), a);
            }
            Value::Object(o)
        })
}
