//! The rooms of `src/` import only downwards: docs/ARCHITECTURE.md lists them from the
//! top (`app`) to the bottom (`config`) in its "Layers" block, and this test reads every
//! file of `src/` and fails on a `crate::` path that names a room on its own line or
//! above it. A circle between rooms cannot pass: one of its imports runs upwards.

use std::collections::HashMap;
use std::path::Path;

/// The layer of each room, 0 at the top, read from the fenced block after the
/// `## Layers` heading of docs/ARCHITECTURE.md: one line a layer, rooms separated by
/// spaces, anything after `#` a comment.
fn layers(architecture: &str) -> HashMap<String, usize> {
    let text = format!("\n{architecture}");
    let after = text
        .split("\n## Layers")
        .nth(1)
        .expect("docs/ARCHITECTURE.md has a \"## Layers\" section");
    let block = after
        .split("```")
        .nth(1)
        .expect("the Layers section has a fenced block");
    let mut out = HashMap::new();
    for (level, line) in block
        .lines()
        .skip(1)
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter(|l| !l.is_empty())
        .enumerate()
    {
        for room in line.split_whitespace() {
            assert!(
                out.insert(room.to_string(), level).is_none(),
                "room {room} is listed twice in the Layers block"
            );
        }
    }
    out
}

/// The source without comments (line comments, doc comments and block comments) and
/// without its test module (a `#[cfg(test)] mod` runs to the end of the file here).
fn code(source: &str) -> String {
    let source = match source.find("#[cfg(test)]\nmod ") {
        Some(at) => &source[..at],
        None => source,
    };
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while !rest.is_empty() {
        if rest.starts_with("//") {
            let end = rest.find('\n').unwrap_or(rest.len());
            rest = &rest[end..];
        } else if rest.starts_with("/*") {
            let end = rest.find("*/").map_or(rest.len(), |e| e + 2);
            // Its line breaks stay, so line numbers stay true.
            out.extend(rest[..end].matches('\n').map(|_| '\n'));
            rest = &rest[end..];
        } else if rest.starts_with('"') {
            // A string literal: skipped whole, so a "//" inside it is not a comment.
            let mut chars = rest.char_indices().skip(1);
            let mut end = rest.len();
            while let Some((i, c)) = chars.next() {
                match c {
                    '\\' => {
                        chars.next();
                    }
                    '"' => {
                        end = i + 1;
                        break;
                    }
                    _ => {}
                }
            }
            out.push_str("\"\"");
            out.extend(rest[..end].matches('\n').map(|_| '\n'));
            rest = &rest[end..];
        } else {
            let c = rest.chars().next().unwrap();
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    out
}

/// The rooms a piece of code names through `crate::`: `crate::room::...`,
/// `crate::room` and each room of `use crate::{a, b::c}`, with the line each is on.
fn named_rooms(code: &str) -> Vec<(String, usize)> {
    let mut out = Vec::new();
    for (at, _) in code.match_indices("crate::") {
        let line = code[..at].matches('\n').count() + 1;
        let rest = &code[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // Top-level names of the group only: nested braces belong to a room already
            // named.
            let mut depth = 0;
            let mut name = String::new();
            let mut expect_name = true;
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        if !name.is_empty() {
                            out.push((std::mem::take(&mut name), line));
                        }
                        expect_name = true;
                    }
                    c if depth == 0 && expect_name && (c.is_alphanumeric() || c == '_') => {
                        name.push(c)
                    }
                    _ if depth == 0 && expect_name && !name.is_empty() => {
                        out.push((std::mem::take(&mut name), line));
                        expect_name = false;
                    }
                    _ => {}
                }
            }
            if !name.is_empty() {
                out.push((name, line));
            }
        } else {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                out.push((name, line));
            }
        }
    }
    out
}

/// Every import in `files` (room, path, source) that runs upwards or sideways:
/// `path:line: room -> named room`.
fn upward(files: &[(String, String, String)], layers: &HashMap<String, usize>) -> Vec<String> {
    let mut out = Vec::new();
    for (room, path, source) in files {
        let Some(&from) = layers.get(room) else {
            out.push(format!("{path}: room {room} is not in the Layers block"));
            continue;
        };
        for (named, line) in named_rooms(&code(source)) {
            if named == *room {
                continue;
            }
            match layers.get(&named) {
                Some(&to) if to > from => {}
                Some(_) => out.push(format!("{path}:{line}: {room} -> {named}")),
                // Not a room (a macro or an item of lib.rs).
                None => {}
            }
        }
    }
    out
}

/// Every `.rs` file under `dir`, with the room it belongs to (its first path component
/// under `src/`, without `.rs`).
fn sources(src: &Path) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let rel = path.strip_prefix(src).unwrap();
                let first = rel.components().next().unwrap().as_os_str();
                let room = first.to_string_lossy().trim_end_matches(".rs").to_string();
                if room == "lib" || room == "main" {
                    continue;
                }
                let text = std::fs::read_to_string(&path).unwrap();
                out.push((room, format!("src/{}", rel.display()), text));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn imports_only_point_down_the_layers() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let layers = layers(&std::fs::read_to_string(root.join("docs/ARCHITECTURE.md")).unwrap());
    let files = sources(&root.join("src"));
    let rooms: std::collections::BTreeSet<&String> = files.iter().map(|f| &f.0).collect();
    for room in layers.keys() {
        assert!(
            rooms.contains(room),
            "the Layers block names {room}, which is not a room of src/"
        );
    }
    let bad = upward(&files, &layers);
    assert!(
        bad.is_empty(),
        "imports that run up (or across) docs/ARCHITECTURE.md's Layers:\n{}",
        bad.join("\n")
    );
}

#[test]
fn an_upward_import_is_caught() {
    let layers = layers("## Layers\n\n```text\nproxy   # top\nlimiter\nconfig\n```\n");
    let file = |room: &str, text: &str| (room.to_string(), format!("src/{room}.rs"), text.into());
    let down = [
        file(
            "proxy",
            "use crate::limiter::Limiter;\nuse crate::{config, limiter::X};\n",
        ),
        file(
            "limiter",
            "// crate::proxy in a comment\nlet s = \"crate::proxy\";\n",
        ),
    ];
    assert!(upward(&down, &layers).is_empty());
    let up = [file("config", "fn f() {\n    crate::limiter::go();\n}\n")];
    assert_eq!(upward(&up, &layers), ["src/config.rs:2: config -> limiter"]);
    let grouped = [file("limiter", "use crate::{config, proxy::{A, B}};\n")];
    assert_eq!(
        upward(&grouped, &layers),
        ["src/limiter.rs:1: limiter -> proxy"]
    );
    let sideways = layers_with_peers();
    let across = [file("a", "use crate::b::X;\n")];
    assert_eq!(upward(&across, &sideways), ["src/a.rs:1: a -> b"]);
}

fn layers_with_peers() -> HashMap<String, usize> {
    layers("## Layers\n```\na b\nc\n```\n")
}
