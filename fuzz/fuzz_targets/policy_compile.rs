//! The policy compiler on any input: it must never panic, and every error it reports must point
//! at a real place (a file it was given, a line that exists, a column within that line).
//!
//! A NUL byte splits the input into two files, so cross-file checks (sections defined twice,
//! names defined in one file and used in another) are reached too.

#![no_main]

use levee::config::{compile, SourceFile};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let files: Vec<SourceFile> = text
        .splitn(2, '\0')
        .enumerate()
        .map(|(index, text)| SourceFile {
            path: format!("{index}0-policy.toml").into(),
            text: text.to_string(),
        })
        .collect();
    let Err(errors) = compile(&files, None) else {
        return;
    };
    assert!(!errors.0.is_empty(), "a failed compile must say why");
    for error in &errors.0 {
        let file = files
            .iter()
            .find(|file| file.path == error.file)
            .unwrap_or_else(|| panic!("{error}: not one of the files given"));
        let lines: Vec<&str> = file.text.split('\n').collect();
        assert!(
            (1..=lines.len()).contains(&error.line),
            "{error}: line out of range"
        );
        let line = lines[error.line - 1];
        assert!(
            (1..=line.chars().count() + 1).contains(&error.col),
            "{error}: column out of range"
        );
    }
});
