//! Diagnostics that point at the exact place of a policy error.

use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// One policy file's text, kept so that byte offsets can become `line:col`.
#[derive(Debug, Clone)]
pub struct SourceFile {
    pub path: PathBuf,
    pub text: String,
}

impl SourceFile {
    /// 1-based line and column (in characters) of a byte offset.
    pub fn line_col(&self, offset: usize) -> (usize, usize) {
        let offset = offset.min(self.text.len());
        let before = self.text.get(..offset).unwrap_or(&self.text);
        let line = before.matches('\n').count() + 1;
        let line_start = before.rfind('\n').map(|i| i + 1).unwrap_or(0);
        let col = before
            .get(line_start..)
            // A byte order mark before the first line is no column an editor shows.
            .map(|s| {
                s.strip_prefix('\u{feff}')
                    .filter(|_| line_start == 0)
                    .unwrap_or(s)
            })
            .map(|s| s.chars().count())
            .unwrap_or(0)
            + 1;
        (line, col)
    }
}

/// A policy error with its location and a one-line hint for the operator.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Diagnostic {
    pub file: PathBuf,
    pub line: usize,
    pub col: usize,
    pub message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hint: Option<String>,
    /// An error refuses the policy; a warning lets it load and names something in it that
    /// does nothing (a limit no route uses), which is most often a mistake.
    pub severity: Severity,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Error,
    Warning,
}

impl Severity {
    fn word(self) -> &'static str {
        match self {
            Severity::Error => "error",
            Severity::Warning => "warning",
        }
    }
}

impl Diagnostic {
    pub fn at(file: &SourceFile, span: Range<usize>, message: impl Into<String>) -> Self {
        let (line, col) = file.line_col(span.start);
        Diagnostic {
            file: file.path.clone(),
            line,
            col,
            message: message.into(),
            hint: None,
            severity: Severity::Error,
        }
    }

    /// An error about the directory or a file as a whole (no position inside it).
    pub fn whole(path: &Path, message: impl Into<String>) -> Self {
        Diagnostic {
            file: path.to_path_buf(),
            line: 0,
            col: 0,
            message: message.into(),
            hint: None,
            severity: Severity::Error,
        }
    }

    pub fn hint(mut self, hint: impl Into<String>) -> Self {
        self.hint = Some(hint.into());
        self
    }

    /// The diagnostic on one line, its hint in brackets, for the log: log lines are read and
    /// searched one at a time, and a line-based collector splits a multi-line entry.
    pub fn one_line(&self) -> String {
        let severity = self.severity.word();
        let hint = self
            .hint
            .as_deref()
            .map_or(String::new(), |hint| format!(" (hint: {hint})"));
        format!("{}: {severity}: {}{hint}", self.location(), self.message)
    }

    /// `file:line:col` (or just `file` when the error has no position).
    pub fn location(&self) -> String {
        if self.line == 0 {
            self.file.display().to_string()
        } else {
            format!("{}:{}:{}", self.file.display(), self.line, self.col)
        }
    }
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let severity = self.severity.word();
        write!(f, "{}: {severity}: {}", self.location(), self.message)?;
        if let Some(hint) = &self.hint {
            write!(f, "\n  hint: {hint}")?;
        }
        Ok(())
    }
}

/// All errors of one failed load, in file order.
#[derive(Debug, Clone, Default)]
pub struct Diagnostics(pub Vec<Diagnostic>);

impl fmt::Display for Diagnostics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, diagnostic) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{diagnostic}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Diagnostics {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_col_counts_lines_and_characters() {
        let file = SourceFile {
            path: "a.toml".into(),
            text: "a = 1\nbé = 2\n".into(),
        };
        assert_eq!(file.line_col(0), (1, 1));
        let marked = SourceFile {
            path: "a.toml".into(),
            text: "\u{feff}a = 1\n".into(),
        };
        assert_eq!(marked.line_col(3), (1, 1), "after the byte order mark");
        assert_eq!(marked.line_col(7), (1, 5));
        assert_eq!(file.line_col(6), (2, 1));
        // "bé " is 4 bytes but 3 characters.
        assert_eq!(file.line_col(10), (2, 4));
    }
}
