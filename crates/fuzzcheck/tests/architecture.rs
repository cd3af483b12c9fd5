//! docs/ARCHITECTURE.md's crate table is true to the code: its "depends
//! on" column lists exactly the `lull-*` crates each crate has in its
//! `[dependencies]` (from `cargo metadata`), and every dependency stands on
//! a lower floor than the crate that uses it. A failure lists every
//! difference at once.
//!
//! The check lives here because this crate already has `serde_json` and is
//! built by every `cargo test --workspace`; it reads only manifests
//! (`cargo metadata --no-deps --offline`), so it needs no network and
//! builds nothing.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace root: this crate is `crates/fuzzcheck`.
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The name a crate has in the table: `lull-net` is `net`, `lull` is
/// `lull`; `None` for a crate that is not lull's.
fn short_name(package: &str) -> Option<&str> {
    if package == "lull" {
        Some(package)
    } else {
        package.strip_prefix("lull-")
    }
}

/// Each workspace crate and the lull crates among its normal
/// dependencies (not dev or build ones), from `cargo metadata`.
fn metadata_dependencies() -> BTreeMap<String, BTreeSet<String>> {
    // The cargo running the tests, else the one that built them.
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| env!("CARGO").into());
    let out = Command::new(&cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(workspace_root())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", Path::new(&cargo).display()));
    assert!(
        out.status.success(),
        "cargo metadata failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("cargo metadata prints JSON");
    let packages = meta["packages"].as_array().expect("packages");
    let mut crates = BTreeMap::new();
    for package in packages {
        let name = package["name"].as_str().expect("package name");
        let Some(short) = short_name(name) else {
            continue;
        };
        let deps = package["dependencies"]
            .as_array()
            .expect("dependencies")
            .iter()
            .filter(|d| d["kind"].is_null())
            .filter_map(|d| short_name(d["name"].as_str().expect("dependency name")))
            .map(str::to_owned)
            .collect();
        crates.insert(short.to_owned(), deps);
    }
    assert!(
        crates.len() > 1,
        "cargo metadata listed no lull crates: {crates:?}"
    );
    crates
}

/// One row of the table.
#[derive(Debug)]
struct Row {
    floor: u32,
    deps: BTreeSet<String>,
    line: usize,
}

/// The crate table of docs/ARCHITECTURE.md (the one whose header has
/// "floor", "crate" and "depends on"), by crate. The "depends on" cell is
/// a comma-separated list of short names (`—` for none); text in
/// parentheses is a note, not a dependency.
fn table(doc: &str) -> Result<BTreeMap<String, Row>, String> {
    let cells = |line: &str| -> Vec<String> {
        let line = line.trim().replace("\\|", "/");
        let line = line.strip_prefix('|').unwrap_or(&line);
        let line = line.strip_suffix('|').unwrap_or(line);
        line.split('|').map(|c| c.trim().to_owned()).collect()
    };
    let lines: Vec<&str> = doc.lines().collect();
    let header = lines
        .iter()
        .position(|l| {
            let c = cells(l);
            l.trim_start().starts_with('|')
                && c.iter().any(|c| c == "floor")
                && c.iter().any(|c| c == "crate")
                && c.iter().any(|c| c == "depends on")
        })
        .ok_or("no table with the columns floor, crate and depends on")?;
    let head = cells(lines[header]);
    let col = |name: &str| head.iter().position(|c| c == name).expect("column");
    let (floor_col, crate_col, deps_col) = (col("floor"), col("crate"), col("depends on"));
    let mut rows = BTreeMap::new();
    // Past the header and its |---| line, up to the first non-table line.
    for (i, line) in lines.iter().enumerate().skip(header + 2) {
        if !line.trim_start().starts_with('|') {
            break;
        }
        let line_no = i + 1;
        let c = cells(line);
        if c.len() != head.len() {
            return Err(format!(
                "line {line_no}: {} cells, the header has {}",
                c.len(),
                head.len()
            ));
        }
        let floor = c[floor_col]
            .parse()
            .map_err(|e| format!("line {line_no}: floor {:?}: {e}", c[floor_col]))?;
        let name = c[crate_col].trim_matches('`').to_owned();
        let deps = parse_deps(&c[deps_col]);
        let row = Row {
            floor,
            deps,
            line: line_no,
        };
        if let Some(first) = rows.insert(name.clone(), row) {
            return Err(format!(
                "line {line_no}: crate {name} has a row already (line {})",
                first.line
            ));
        }
    }
    Ok(rows)
}

/// "bdev, reactor (timerfd, epoll), `uring`" → {bdev, reactor, uring}.
fn parse_deps(cell: &str) -> BTreeSet<String> {
    let mut plain = String::new();
    let mut depth = 0u32;
    for ch in cell.chars() {
        match ch {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            _ if depth == 0 => plain.push(ch),
            _ => {}
        }
    }
    plain
        .split(',')
        .map(|d| d.trim().trim_matches('`').trim())
        .filter(|d| !d.is_empty() && *d != "—" && *d != "-")
        .map(str::to_owned)
        .collect()
}

/// Every way the table and the metadata disagree, and every dependency
/// that does not stand on a lower floor than its user.
fn differences(
    table: &BTreeMap<String, Row>,
    metadata: &BTreeMap<String, BTreeSet<String>>,
) -> Vec<String> {
    let mut found = Vec::new();
    for (name, deps) in metadata {
        let Some(row) = table.get(name) else {
            found.push(format!(
                "crate {name} (depends on {}) has no row",
                list(deps)
            ));
            continue;
        };
        let missing: BTreeSet<_> = deps.difference(&row.deps).cloned().collect();
        let extra: BTreeSet<_> = row.deps.difference(deps).cloned().collect();
        if !missing.is_empty() {
            found.push(format!(
                "{name} (line {}): depends on {} but the row does not say so",
                row.line,
                list(&missing)
            ));
        }
        if !extra.is_empty() {
            found.push(format!(
                "{name} (line {}): the row lists {}, which Cargo.toml does not depend on",
                row.line,
                list(&extra)
            ));
        }
        for dep in deps {
            match table.get(dep) {
                Some(d) if d.floor >= row.floor => found.push(format!(
                    "{name} (floor {}) imports {dep} (floor {}): not a lower floor",
                    row.floor, d.floor
                )),
                _ => {}
            }
        }
    }
    for (name, row) in table {
        if !metadata.contains_key(name) {
            found.push(format!(
                "line {}: crate {name} is not in the workspace",
                row.line
            ));
        }
    }
    found
}

fn list(names: &BTreeSet<String>) -> String {
    if names.is_empty() {
        "nothing".into()
    } else {
        names.iter().cloned().collect::<Vec<_>>().join(", ")
    }
}

#[test]
fn architecture_table_matches_cargo_metadata() {
    let path = workspace_root().join("docs/ARCHITECTURE.md");
    let doc = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let rows = table(&doc).unwrap_or_else(|e| panic!("docs/ARCHITECTURE.md: {e}"));
    let found = differences(&rows, &metadata_dependencies());
    assert!(
        found.is_empty(),
        "docs/ARCHITECTURE.md's crate table disagrees with cargo metadata \
         (fix the row, or move the crate up a floor):\n  {}",
        found.join("\n  ")
    );
}

/// The checker itself finds what it exists to find.
#[test]
fn differences_are_all_reported() {
    let doc = "\
| floor | crate | what it is | depends on |
|---|---|---|---|
| 0 | `a` | bottom | — |
| 1 | `b` | middle | a (for x, y) |
| 1 | `c` | beside b | `a`, b |
| 2 | `gone` | removed | a |

after the table
";
    let rows = table(doc).expect("table");
    assert_eq!(rows["b"].deps, BTreeSet::from(["a".to_owned()]));
    let set = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    let metadata = BTreeMap::from([
        ("a".to_owned(), set(&[])),
        ("b".to_owned(), set(&["a", "c"])),
        ("c".to_owned(), set(&["a", "b"])),
        ("new".to_owned(), set(&["a"])),
    ]);
    let found = differences(&rows, &metadata);
    let want = [
        "b (line 4): depends on c but the row does not say so",
        "b (floor 1) imports c (floor 1): not a lower floor",
        "c (floor 1) imports b (floor 1): not a lower floor",
        "crate new (depends on a) has no row",
        "line 6: crate gone is not in the workspace",
    ];
    assert_eq!(found, want, "{found:#?}");
    assert!(table("no table here").is_err());
}

// ---------------------------------------------------------------------
// The other maps: the README's Layout and its links to docs/, each
// directory module's file list, and the import circles inside crates.
// ---------------------------------------------------------------------

/// The crates under `crates/` (each folder with a Cargo.toml).
fn crate_dirs() -> BTreeSet<String> {
    let dir = workspace_root().join("crates");
    let mut out = BTreeSet::new();
    for entry in std::fs::read_dir(&dir).expect("crates/") {
        let entry = entry.expect("crates/ entry");
        if entry.path().join("Cargo.toml").is_file() {
            out.insert(entry.file_name().to_string_lossy().into_owned());
        }
    }
    out
}

/// The crates the README's `## Layout` block names (`crates/NAME ...`
/// lines of its first fenced block).
fn readme_layout(readme: &str) -> Result<BTreeSet<String>, String> {
    let start = readme
        .lines()
        .position(|l| l.trim() == "## Layout")
        .ok_or("no \"## Layout\" section")?;
    let mut lines = readme.lines().skip(start + 1);
    lines
        .by_ref()
        .find(|l| l.trim_start().starts_with("```"))
        .ok_or("no fenced block after \"## Layout\"")?;
    let mut out = BTreeSet::new();
    for line in lines {
        if line.trim_start().starts_with("```") {
            return Ok(out);
        }
        if let Some(rest) = line.trim().strip_prefix("crates/") {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == '-')
                .collect();
            out.insert(name);
        }
    }
    Err("the Layout block is not closed".into())
}

/// Names in `a` and not in `b`, and in `b` and not in `a`.
fn both_ways(a: &BTreeSet<String>, b: &BTreeSet<String>) -> (Vec<String>, Vec<String>) {
    (
        a.difference(b).cloned().collect(),
        b.difference(a).cloned().collect(),
    )
}

#[test]
fn readme_layout_names_every_crate() {
    let readme = std::fs::read_to_string(workspace_root().join("README.md")).expect("README.md");
    let listed = readme_layout(&readme).unwrap_or_else(|e| panic!("README.md: {e}"));
    let (missing, gone) = both_ways(&crate_dirs(), &listed);
    assert!(
        missing.is_empty() && gone.is_empty(),
        "README.md's Layout: crates it does not name: {missing:?}; names that are no crate: {gone:?}"
    );
}

/// Every page in docs/ that the README does not link (`docs/NAME.md`).
fn unlinked_pages(readme: &str, pages: &BTreeSet<String>) -> Vec<String> {
    pages
        .iter()
        .filter(|p| !readme.contains(&format!("](docs/{p})")))
        .cloned()
        .collect()
}

#[test]
fn readme_links_every_page_in_docs() {
    let root = workspace_root();
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    let pages: BTreeSet<String> = std::fs::read_dir(root.join("docs"))
        .expect("docs/")
        .map(|e| {
            e.expect("docs/ entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|n| n.ends_with(".md"))
        .collect();
    assert!(!pages.is_empty(), "no page in docs/");
    let missing = unlinked_pages(&readme, &pages);
    assert!(
        missing.is_empty(),
        "README.md links no docs/ page of these (a row of \"Where the rest lives\"): {missing:?}"
    );
}

/// The `.rs` files under `dir`, recursively.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// A module file's children: the modules in its directory (`mod.rs`,
/// `lib.rs`, `main.rs`: the folder it is in; `x.rs`: the folder `x/`),
/// by name. A `tests` child is not listed (it is the module's tests).
fn child_modules(file: &Path) -> BTreeSet<String> {
    let stem = file
        .file_stem()
        .expect("stem")
        .to_string_lossy()
        .into_owned();
    let dir = match stem.as_str() {
        "mod" | "lib" | "main" => file.parent().expect("parent").to_path_buf(),
        _ => file.with_extension(""),
    };
    let mut out = BTreeSet::new();
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return out;
    };
    for entry in entries {
        let path = entry.expect("dir entry").path();
        let name = path
            .file_stem()
            .expect("stem")
            .to_string_lossy()
            .into_owned();
        let module = if path.is_dir() {
            path.join("mod.rs").is_file()
        } else {
            path.extension().is_some_and(|e| e == "rs")
        };
        if module && !matches!(name.as_str(), "mod" | "lib" | "main" | "tests") {
            out.insert(name);
        }
    }
    out
}

/// The modules a module doc's `# Layout` section lists: its bullets
/// ``//! - `name`...`` (several names on one bullet as `` `a`, `b` ``
/// before the first colon). `None` without such a section.
fn layout_list(source: &str) -> Option<BTreeSet<String>> {
    let doc: Vec<&str> = source
        .lines()
        .take_while(|l| l.starts_with("//!") || l.trim().is_empty())
        .filter_map(|l| l.strip_prefix("//!"))
        .map(str::trim)
        .collect();
    let start = doc.iter().position(|l| *l == "# Layout")?;
    let mut out = BTreeSet::new();
    for line in &doc[start + 1..] {
        if line.starts_with('#') {
            break;
        }
        let Some(item) = line.strip_prefix("- ") else {
            continue;
        };
        let head = item.split(':').next().unwrap_or("");
        for name in head.split(',') {
            let name = name
                .trim()
                .trim_matches(|c| c == '`' || c == '[' || c == ']');
            if !name.is_empty() {
                out.insert(name.to_owned());
            }
        }
    }
    Some(out)
}

#[test]
fn module_layouts_list_their_files() {
    let root = workspace_root();
    let mut files = Vec::new();
    rust_files(&root.join("crates"), &mut files);
    let mut found = Vec::new();
    for file in files
        .iter()
        .filter(|f| f.components().any(|c| c.as_os_str() == "src"))
    {
        let rel = file
            .strip_prefix(&root)
            .unwrap_or(file)
            .display()
            .to_string();
        let source = std::fs::read_to_string(file).expect("source");
        let children = child_modules(file);
        let stem = file
            .file_stem()
            .expect("stem")
            .to_string_lossy()
            .into_owned();
        let directory_module = !children.is_empty() && !matches!(stem.as_str(), "lib" | "main");
        match layout_list(&source) {
            None if directory_module => found.push(format!(
                "{rel}: a module with files of its own ({}) has no \"# Layout\" list in its doc",
                children.iter().cloned().collect::<Vec<_>>().join(", ")
            )),
            None => {}
            Some(listed) => {
                let (missing, gone) = both_ways(&children, &listed);
                if !missing.is_empty() || !gone.is_empty() {
                    found.push(format!(
                        "{rel}: its Layout does not list {missing:?}; lists {gone:?}, which are not its files"
                    ));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "module docs disagree with their folders:\n  {}",
        found.join("\n  ")
    );
}

/// A module's path inside its crate, from its file: `src/a/b.rs` and
/// `src/a/b/mod.rs` are `["a", "b"]`, `src/lib.rs` is `[]`.
fn module_path(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).expect("under src");
    let mut parts: Vec<String> = rel
        .with_extension("")
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts
}

/// `source` without comments, string literals' contents and `#[cfg(test)]`
/// modules (a test may import anything of its crate).
fn code_of(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut chars = source.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '/' if chars.peek() == Some(&'/') => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        out.push('\n');
                        break;
                    }
                }
            }
            '/' if chars.peek() == Some(&'*') => {
                let mut prev = ' ';
                for c in chars.by_ref() {
                    if prev == '*' && c == '/' {
                        break;
                    }
                    prev = c;
                }
            }
            '"' => {
                out.push('"');
                let mut escaped = false;
                for c in chars.by_ref() {
                    if !escaped && c == '"' {
                        break;
                    }
                    escaped = !escaped && c == '\\';
                }
                out.push('"');
            }
            _ => out.push(c),
        }
    }
    match out.find("#[cfg(test)]\nmod tests") {
        Some(at) => out[..at].to_owned(),
        None => out,
    }
}

/// Every path `crate::..`, `super::..` or `self::..` in `code`, use trees
/// expanded (`use crate::a::{b, c::d}` gives `crate::a::b` and
/// `crate::a::c::d`), as segments.
fn paths_in(code: &str) -> Vec<Vec<String>> {
    let bytes: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let starts = |w: &str| {
            let w: Vec<char> = w.chars().collect();
            bytes[i..].starts_with(&w) && (i == 0 || !is_ident(bytes[i - 1]))
        };
        if starts("crate::") || starts("super::") || starts("self::") {
            let (paths, end) = use_tree(&bytes, i);
            out.extend(paths);
            i = end.max(i + 1);
        } else {
            i += 1;
        }
    }
    out
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Parses a path or use tree starting at `at`; returns the full paths it
/// names and where it ends.
fn use_tree(s: &[char], mut at: usize) -> (Vec<Vec<String>>, usize) {
    let mut prefix = Vec::new();
    loop {
        let start = at;
        while at < s.len() && is_ident(s[at]) {
            at += 1;
        }
        if at > start {
            prefix.push(s[start..at].iter().collect::<String>());
        }
        if s[at..].starts_with(&[':', ':']) {
            at += 2;
            if at < s.len() && s[at] == '{' {
                at += 1;
                let mut out = Vec::new();
                loop {
                    while at < s.len() && s[at].is_whitespace() {
                        at += 1;
                    }
                    if at >= s.len() || s[at] == '}' {
                        return (out, at + 1);
                    }
                    let (inner, end) = use_tree(s, at);
                    for p in inner {
                        let mut full = prefix.clone();
                        full.extend(p.into_iter().filter(|seg| seg != "self"));
                        out.push(full);
                    }
                    at = end;
                    while at < s.len() && (s[at].is_whitespace() || s[at] == ',') {
                        at += 1;
                    }
                    // `a as b`: the alias is not a path.
                    if s[at..].starts_with(&['a', 's', ' ']) {
                        at += 3;
                        while at < s.len() && (is_ident(s[at]) || s[at].is_whitespace()) {
                            at += 1;
                        }
                        while at < s.len() && (s[at].is_whitespace() || s[at] == ',') {
                            at += 1;
                        }
                    }
                }
            }
            continue;
        }
        return (vec![prefix], at);
    }
}

/// The import circles inside one crate: sets of two or more sibling or
/// cousin modules that reach each other through `crate::`, `super::` or
/// `self::` paths (a module's own ancestors and descendants are not
/// edges: a parent declares its children, a child reads its parent).
fn crate_circles(src: &Path) -> Vec<BTreeSet<String>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let modules: BTreeMap<Vec<String>, PathBuf> = files
        .iter()
        .map(|f| (module_path(src, f), f.clone()))
        .filter(|(m, _)| m.last().map(String::as_str) != Some("tests"))
        .collect();
    let resolve = |path: &[String]| -> Option<Vec<String>> {
        (1..=path.len())
            .rev()
            .map(|k| path[..k].to_vec())
            .find(|p| modules.contains_key(p))
    };
    let mut edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    for (module, file) in &modules {
        let source = std::fs::read_to_string(file).expect("source");
        let is_dir_module = matches!(
            file.file_stem().and_then(|s| s.to_str()),
            Some("mod" | "lib" | "main")
        );
        let targets = edges.entry(module.clone()).or_default();
        for path in paths_in(&code_of(&source)) {
            let mut base: Vec<String> = match path[0].as_str() {
                "crate" => Vec::new(),
                "self" if is_dir_module => module.clone(),
                "self" => module.clone(),
                // `super` of `a::b` is `a` for `a/b.rs` and `a/b/mod.rs` alike.
                _ => module[..module.len().saturating_sub(1)].to_vec(),
            };
            let mut rest = &path[1..];
            while rest.first().map(String::as_str) == Some("super") {
                base.pop();
                rest = &rest[1..];
            }
            base.extend(rest.iter().cloned());
            let Some(target) = resolve(&base) else {
                continue;
            };
            let related = target.starts_with(module) || module.starts_with(&target);
            if !related {
                targets.insert(target);
            }
        }
    }
    strongly_connected(&edges)
        .into_iter()
        .filter(|c| c.len() > 1)
        .map(|c| c.into_iter().map(|m| m.join("::")).collect())
        .collect()
}

/// Tarjan's strongly connected components.
fn strongly_connected(
    edges: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
) -> Vec<Vec<Vec<String>>> {
    struct State<'a> {
        edges: &'a BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        index: BTreeMap<&'a Vec<String>, usize>,
        low: BTreeMap<&'a Vec<String>, usize>,
        stack: Vec<&'a Vec<String>>,
        on: BTreeSet<&'a Vec<String>>,
        out: Vec<Vec<Vec<String>>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a Vec<String>) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on.insert(v);
        for w in s.edges.get(v).into_iter().flatten() {
            let Some((w, _)) = s.edges.get_key_value(w) else {
                continue;
            };
            if !s.index.contains_key(w) {
                visit(s, w);
                let low = s.low[v].min(s.low[w]);
                s.low.insert(v, low);
            } else if s.on.contains(w) {
                let low = s.low[v].min(s.index[w]);
                s.low.insert(v, low);
            }
        }
        if s.low[v] == s.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on.remove(w);
                comp.push(w.clone());
                if w == v {
                    break;
                }
            }
            s.out.push(comp);
        }
    }
    let mut s = State {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in edges.keys() {
        if !s.index.contains_key(v) {
            visit(&mut s, v);
        }
    }
    s.out
}

/// The circles docs/ARCHITECTURE.md keeps on purpose: the rows of the
/// table whose header has "crate", "modules in the circle" and "why"
/// (modules as `` `a` ↔ `b` `` or comma-separated), as "crate: a, b".
fn kept_circles(doc: &str) -> Result<BTreeSet<String>, String> {
    let cells = |line: &str| -> Vec<String> {
        let line = line.trim();
        let line = line.strip_prefix('|').unwrap_or(line);
        let line = line.strip_suffix('|').unwrap_or(line);
        line.split('|').map(|c| c.trim().to_owned()).collect()
    };
    let lines: Vec<&str> = doc.lines().collect();
    let header = lines
        .iter()
        .position(|l| {
            let c = cells(l);
            l.trim_start().starts_with('|')
                && c.iter().any(|c| c == "crate")
                && c.iter().any(|c| c == "modules in the circle")
                && c.iter().any(|c| c == "why")
        })
        .ok_or("no table with the columns crate, modules in the circle and why")?;
    let head = cells(lines[header]);
    let col = |name: &str| head.iter().position(|c| c == name).expect("column");
    let (crate_col, modules_col) = (col("crate"), col("modules in the circle"));
    let mut out = BTreeSet::new();
    for line in lines.iter().skip(header + 2) {
        if !line.trim_start().starts_with('|') {
            break;
        }
        let c = cells(line);
        let krate = c[crate_col].trim_matches('`');
        let modules: BTreeSet<String> = c[modules_col]
            .split(['↔', ','])
            .map(|m| m.trim().trim_matches('`').to_owned())
            .filter(|m| !m.is_empty())
            .collect();
        out.insert(format!(
            "{krate}: {}",
            modules.into_iter().collect::<Vec<_>>().join(", ")
        ));
    }
    Ok(out)
}

#[test]
fn import_circles_are_only_those_architecture_keeps() {
    let root = workspace_root();
    let mut found = BTreeSet::new();
    for krate in crate_dirs() {
        let src = root.join("crates").join(&krate).join("src");
        for circle in crate_circles(&src) {
            found.insert(format!(
                "{krate}: {}",
                circle.into_iter().collect::<Vec<_>>().join(", ")
            ));
        }
    }
    let doc = std::fs::read_to_string(root.join("docs/ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let kept = kept_circles(&doc).unwrap_or_else(|e| panic!("docs/ARCHITECTURE.md: {e}"));
    let new: Vec<_> = found.difference(&kept).collect();
    let gone: Vec<_> = kept.difference(&found).collect();
    assert!(
        new.is_empty() && gone.is_empty(),
        "import circles inside crates: not kept in docs/ARCHITECTURE.md (cut them, or add a row \
         with the reason): {new:?}; kept there but no longer found (remove the row): {gone:?}"
    );
}

/// The checkers find what they exist to find, on made-up input.
#[test]
fn map_checkers_find_what_is_wrong() {
    // The Layout block.
    let readme = "x\n## Layout\n\n```\ncrates/a  one\ncrates/b-c two\nfuzz/ no\n```\n";
    let want: BTreeSet<String> = ["a", "b-c"].iter().map(|s| s.to_string()).collect();
    assert_eq!(readme_layout(readme).expect("layout"), want);
    assert!(readme_layout("## Layout\n```\ncrates/a\n").is_err());
    let pages: BTreeSet<String> = ["A.md", "B.md"].iter().map(|s| s.to_string()).collect();
    assert_eq!(unlinked_pages("see [a](docs/A.md)", &pages), ["B.md"]);
    // A module doc's list.
    let doc = "//! Intro.\n//!\n//! # Layout\n//!\n//! - `a`: one\n//! - [`b`], `c`: two\n//!   more of two: `d`\n//!\n//! # Next\n//! - `e`: not listed\n\nuse x;\n";
    let want: BTreeSet<String> = ["a", "b", "c"].iter().map(|s| s.to_string()).collect();
    assert_eq!(layout_list(doc), Some(want));
    assert_eq!(layout_list("//! No layout.\n"), None);
    // Paths and use trees.
    let code = code_of("use crate::a::{b, c::{d, self as e}};\n// crate::x\nfn f() { super::y::z(); \"crate::s\"; }\n#[cfg(test)]\nmod tests { use crate::t; }\n");
    let got: Vec<String> = paths_in(&code).iter().map(|p| p.join("::")).collect();
    assert_eq!(
        got,
        [
            "crate::a::b",
            "crate::a::c::d",
            "crate::a::c",
            "super::y::z"
        ]
    );
    // Circles.
    let v = |s: &str| s.split("::").map(str::to_owned).collect::<Vec<_>>();
    let edges = BTreeMap::from([
        (v("a"), BTreeSet::from([v("b")])),
        (v("b"), BTreeSet::from([v("a"), v("c")])),
        (v("c"), BTreeSet::new()),
    ]);
    let circles: Vec<_> = strongly_connected(&edges)
        .into_iter()
        .filter(|c| c.len() > 1)
        .collect();
    assert_eq!(circles.len(), 1);
    assert_eq!(circles[0].len(), 2);
    let table =
        "| crate | modules in the circle | why |\n|---|---|---|\n| `u` | `buf` ↔ `arena` | x |\n\n";
    let want: BTreeSet<String> = ["u: arena, buf".to_owned()].into();
    assert_eq!(kept_circles(table).expect("table"), want);
    assert!(kept_circles("no table").is_err());
}
