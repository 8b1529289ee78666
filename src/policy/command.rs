//! A tool's `command` template, parsed once at load: each element is literal text and
//! `{name}` placeholders. The loader checks the placeholders of the parsed template, and a
//! call renders the same parsed template: one scanner, [`tokens`], for both.

use std::borrow::Cow;
use std::collections::BTreeMap;

/// One token of a command element as written: literal text, or a `{name}` placeholder. A
/// view of the written text, for the loader's checks and for tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Token<'a> {
    Text(&'a str),
    Placeholder(&'a str),
}

/// Splits one command element into literal text and placeholders. A `{...}` whose inside is
/// not a name (letters, digits, `_`) is text, and so is a `{` with no `}` after it. Empty
/// text tokens are left out, so joining the tokens back (placeholders with their braces)
/// gives the element exactly.
pub fn tokens(part: &str) -> Vec<Token<'_>> {
    let mut out = Vec::new();
    // `text` is where the current run of literal text began; `at` is where scanning resumes.
    let (mut text, mut at) = (0, 0);
    while let Some(open) = part[at..].find('{').map(|i| at + i) {
        let Some(close) = part[open + 1..].find('}').map(|i| open + 1 + i) else {
            break;
        };
        let name = &part[open + 1..close];
        if !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            if open > text {
                out.push(Token::Text(&part[text..open]));
            }
            out.push(Token::Placeholder(name));
            text = close + 1;
        }
        at = close + 1;
    }
    if part.len() > text {
        out.push(Token::Text(&part[text..]));
    }
    out
}

/// The `{name}` placeholders in one argv element, in order.
pub fn placeholders(s: &str) -> Vec<&str> {
    tokens(s)
        .into_iter()
        .filter_map(|t| match t {
            Token::Placeholder(n) => Some(n),
            Token::Text(_) => None,
        })
        .collect()
}

/// One piece of a parsed command element.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// Literal text, copied as is.
    Lit(String),
    /// A `{name}` placeholder: the value of argument `name` (or `session`).
    Param(String),
}

/// A tool's command template, parsed: one list of pieces per argv element.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Command(Vec<Vec<Piece>>);

impl Command {
    /// Parses each element as written.
    pub fn parse<S: AsRef<str>>(written: impl IntoIterator<Item = S>) -> Command {
        Command(
            written
                .into_iter()
                .map(|part| {
                    tokens(part.as_ref())
                        .into_iter()
                        .map(|t| match t {
                            Token::Text(s) => Piece::Lit(s.to_string()),
                            Token::Placeholder(n) => Piece::Param(n.to_string()),
                        })
                        .collect()
                })
                .collect(),
        )
    }

    /// A command of literal elements only: no placeholder is read in them (airlock's own
    /// commands, such as the Python runner's, whose source holds braces).
    pub fn literal<S: Into<String>>(elements: impl IntoIterator<Item = S>) -> Command {
        Command(
            elements
                .into_iter()
                .map(|e| vec![Piece::Lit(e.into())])
                .collect(),
        )
    }

    /// The parsed elements, in order.
    pub fn elements(&self) -> &[Vec<Piece>] {
        &self.0
    }

    /// Each element as it was written (placeholders with their braces).
    pub fn written(&self) -> Vec<String> {
        self.0
            .iter()
            .map(|pieces| {
                pieces
                    .iter()
                    .map(|p| match p {
                        Piece::Lit(s) => Cow::Borrowed(s.as_str()),
                        Piece::Param(n) => Cow::Owned(format!("{{{n}}}")),
                    })
                    .collect()
            })
            .collect()
    }

    /// The names of the placeholders, in order of appearance (repeats included).
    pub fn params(&self) -> impl Iterator<Item = &str> {
        self.0.iter().flatten().filter_map(|p| match p {
            Piece::Param(n) => Some(n.as_str()),
            Piece::Lit(_) => None,
        })
    }

    /// The elements a call with `values` keeps, in order: all but those that are only a
    /// placeholder of an absent (optional) argument.
    pub fn kept<'a>(
        &'a self,
        values: &'a BTreeMap<String, String>,
    ) -> impl Iterator<Item = &'a [Piece]> + 'a {
        self.0
            .iter()
            .filter(move |pieces| {
                !matches!(pieces.as_slice(), [Piece::Param(n)] if !values.contains_key(n))
            })
            .map(Vec::as_slice)
    }

    /// The argv with `values` substituted, in one pass over the template: the text of a
    /// value is copied as data and never scanned again, so a value holding `{out}` stays
    /// `{out}`. An element that is only a placeholder of an absent optional argument is
    /// dropped; any other placeholder of an absent argument becomes empty.
    pub fn render(&self, values: &BTreeMap<String, String>) -> Vec<String> {
        self.kept(values)
            .map(|pieces| {
                let mut s = String::new();
                for piece in pieces {
                    match piece {
                        Piece::Lit(t) => s.push_str(t),
                        Piece::Param(n) => {
                            s.push_str(values.get(n).map(String::as_str).unwrap_or(""))
                        }
                    }
                }
                s
            })
            .collect()
    }
}

/// What a command line can be built from: the template parsed at load, or elements as
/// written (parsed on the way), as tests and tools that build a command in code have them.
pub trait Template {
    fn template(&self) -> Cow<'_, Command>;
}

impl Template for Command {
    fn template(&self) -> Cow<'_, Command> {
        Cow::Borrowed(self)
    }
}

impl Template for [String] {
    fn template(&self) -> Cow<'_, Command> {
        Cow::Owned(Command::parse(self))
    }
}

impl Template for Vec<String> {
    fn template(&self) -> Cow<'_, Command> {
        Cow::Owned(Command::parse(self))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_template_parses_once_and_renders_as_written() {
        let cmd = Command::parse([
            "/bin/x",
            "--out={out}.{ext}",
            "{ not one }",
            "{opt}",
            "{a{b}c}",
        ]);
        assert_eq!(
            cmd.elements()[1],
            vec![
                Piece::Lit("--out=".into()),
                Piece::Param("out".into()),
                Piece::Lit(".".into()),
                Piece::Param("ext".into()),
            ]
        );
        // "{a{b}c}": the first `{` closes at "a{b", which is not a name: all text.
        assert_eq!(cmd.params().collect::<Vec<_>>(), ["out", "ext", "opt"]);
        assert_eq!(
            cmd.written(),
            [
                "/bin/x",
                "--out={out}.{ext}",
                "{ not one }",
                "{opt}",
                "{a{b}c}"
            ]
        );
        let mut v = BTreeMap::new();
        v.insert("out".to_string(), "{ext}".to_string());
        assert_eq!(
            cmd.render(&v),
            ["/bin/x", "--out={ext}.", "{ not one }", "{a{b}c}"]
        );
    }
}
