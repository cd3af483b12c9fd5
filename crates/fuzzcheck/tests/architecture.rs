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
