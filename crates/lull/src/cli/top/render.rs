//! The model as lines of text: a pure function, so the layout is tested
//! without a terminal. [`screen`] fits the interactive view to a width and
//! height (columns that do not fit are dropped, rows that do not fit are
//! counted in a "+N more" line); [`snapshot`] is `--once`'s output, every
//! row and column, whitespace-separated.
//!
//! ```ignore
//! for line in screen(Some(&model), &view, "/var/tmp/lull.sock", 80, 24) {
//!     println!("{}", line.text); // at most 80 characters, 24 lines
//! }
//! ```

use super::model::{Health, Model, Rate, SortKey, View};

/// Widest a name column grows on screen, so one long name does not push
/// every number off an 80-column terminal; `--once` prints names whole.
const NAME_WIDTH_MAX: usize = 24;

/// Widest a replica's last error is shown on screen.
const ERROR_WIDTH_MAX: usize = 32;

/// How a line is drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tone {
    Title,
    Header,
    Body,
    /// A degraded or rebuilding volume, a replica that is not healthy.
    Alert,
    /// A note: rows left out, nothing to show.
    Dim,
    Help,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ScreenLine {
    pub text: String,
    pub tone: Tone,
}

impl ScreenLine {
    fn new(text: String, tone: Tone) -> ScreenLine {
        ScreenLine { text, tone }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Align {
    Left,
    Right,
}

/// A column: its title, alignment, and rank (0 is never dropped; the
/// highest rank goes first when the screen is too narrow).
#[derive(Debug, Clone, Copy)]
struct Column {
    title: &'static str,
    align: Align,
    rank: u8,
    /// On screen, the most it grows to (longer cells are cut with `~`).
    width_max: Option<usize>,
}

const fn col(title: &'static str, align: Align, rank: u8) -> Column {
    Column {
        title,
        align,
        rank,
        width_max: None,
    }
}

const fn name_col(title: &'static str, rank: u8, width_max: usize) -> Column {
    Column {
        title,
        align: Align::Left,
        rank,
        width_max: Some(width_max),
    }
}

#[derive(Debug, Clone)]
enum Row {
    Cells { cells: Vec<String>, alert: bool },
    Note(String),
}

#[derive(Debug, Clone)]
struct Table {
    columns: Vec<Column>,
    rows: Vec<Row>,
}

impl Table {
    fn new(columns: Vec<Column>) -> Table {
        Table {
            columns,
            rows: Vec::new(),
        }
    }

    fn push(&mut self, cells: Vec<String>, alert: bool) {
        debug_assert_eq!(cells.len(), self.columns.len());
        self.rows.push(Row::Cells { cells, alert });
    }

    fn note(&mut self, text: String) {
        self.rows.push(Row::Note(text));
    }

    /// The columns shown and their widths: natural widths, capped on
    /// screen; then, past `width`, the highest-ranked columns dropped and
    /// at last the first column cut.
    fn layout(&self, width: Option<usize>) -> Vec<(usize, usize)> {
        let mut shown: Vec<(usize, usize)> = self
            .columns
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let cells = self.rows.iter().filter_map(|r| match r {
                    Row::Cells { cells, .. } => Some(chars(&cells[i])),
                    Row::Note(_) => None,
                });
                let natural = cells.fold(chars(c.title), usize::max);
                let w = match (width, c.width_max) {
                    (Some(_), Some(max)) => natural.min(max.max(chars(c.title))),
                    _ => natural,
                };
                (i, w)
            })
            .collect();
        let Some(width) = width else {
            return shown;
        };
        let total = |s: &[(usize, usize)]| {
            s.iter().map(|(_, w)| w).sum::<usize>() + s.len().saturating_sub(1)
        };
        while total(&shown) > width {
            let drop = shown
                .iter()
                .enumerate()
                .filter(|(_, (i, _))| self.columns[*i].rank > 0)
                .max_by_key(|(at, (i, _))| (self.columns[*i].rank, *at));
            match drop {
                Some((at, _)) => {
                    shown.remove(at);
                }
                None => break,
            }
        }
        let over = total(&shown).saturating_sub(width);
        if over > 0 {
            if let Some(first) = shown.first_mut() {
                first.1 = first.1.saturating_sub(over).max(1);
            }
        }
        shown
    }

    /// Header and rows as lines.
    fn lines(&self, width: Option<usize>) -> Vec<ScreenLine> {
        let layout = self.layout(width);
        let format = |cells: &[&str]| {
            let mut out = String::new();
            for (n, (i, w)) in layout.iter().enumerate() {
                if n > 0 {
                    out.push(' ');
                }
                out.push_str(&fit(cells[*i], *w, self.columns[*i].align));
            }
            out.trim_end().to_string()
        };
        let titles: Vec<&str> = self.columns.iter().map(|c| c.title).collect();
        let mut lines = vec![ScreenLine::new(format(&titles), Tone::Header)];
        for row in &self.rows {
            lines.push(match row {
                Row::Cells { cells, alert } => {
                    let cells: Vec<&str> = cells.iter().map(String::as_str).collect();
                    let tone = if *alert { Tone::Alert } else { Tone::Body };
                    ScreenLine::new(format(&cells), tone)
                }
                Row::Note(text) => ScreenLine::new(text.clone(), Tone::Dim),
            });
        }
        lines
    }
}

fn chars(s: &str) -> usize {
    s.chars().count()
}

/// `s` in exactly `width` characters: padded, or cut with a `~` at the end.
fn fit(s: &str, width: usize, align: Align) -> String {
    let n = chars(s);
    if n > width {
        let mut cut: String = s.chars().take(width.saturating_sub(1)).collect();
        if width > 0 {
            cut.push('~');
        }
        return cut;
    }
    match align {
        Align::Left => format!("{s:<width$}"),
        Align::Right => format!("{s:>width$}"),
    }
}

/// Cut a line to `width` characters.
fn clip(mut line: ScreenLine, width: usize) -> ScreenLine {
    if chars(&line.text) > width {
        line.text = line.text.chars().take(width).collect();
    }
    line
}

fn count(r: Rate) -> String {
    r.map_or_else(|| "-".into(), |r| format!("{r:.0}"))
}

fn tenths(r: Rate) -> String {
    r.map_or_else(|| "-".into(), |r| format!("{r:.1}"))
}

fn yes_no(b: bool) -> String {
    if b { "yes" } else { "no" }.into()
}

/// A latency bound: `-` when nothing completed yet.
pub(crate) fn latency(ns: u64) -> String {
    match ns {
        0 => "-".into(),
        1..=999 => format!("{ns}ns"),
        1_000..=999_999 => format!("{}us", (ns + 500) / 1_000),
        1_000_000..=999_999_999 => format!("{:.1}ms", ns as f64 / 1e6),
        _ => format!("{:.2}s", ns as f64 / 1e9),
    }
}

/// Bytes with a binary suffix (K, M, G, T, as the size flags take them).
pub(crate) fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["", "K", "M", "G", "T"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n}")
    } else {
        format!("{value:.1}{}", UNITS[unit])
    }
}

fn health(h: &Health) -> String {
    match h {
        Health::Local(kind) => kind.clone(),
        Health::Healthy => "healthy".into(),
        Health::Degraded { healthy, total } => format!("degraded:{healthy}/{total}"),
        Health::Rebuilding { pct } => format!("rebuild:{pct:.0}%"),
        Health::Reconciling { pct } => format!("reconcile:{pct:.0}%"),
    }
}

fn reactors(model: &Model) -> Table {
    use Align::{Left, Right};
    let mut t = Table::new(vec![
        col("REACTOR", Left, 0),
        col("CORE", Right, 1),
        col("MODE", Left, 3),
        col("BUSY%", Right, 1),
        col("CPU%", Right, 4),
        col("SLEEP", Left, 2),
        col("INTR", Left, 5),
        col("WAKE/s", Right, 2),
        col("THREADS", Right, 6),
        col("MOVES", Right, 7),
    ]);
    for r in &model.reactors {
        t.push(
            vec![
                r.index.to_string(),
                r.core.to_string(),
                r.mode.clone(),
                tenths(r.busy_pct),
                tenths(r.cpu_pct),
                yes_no(r.sleeping),
                yes_no(r.interrupt_mode_enabled),
                count(r.wakeups_per_s),
                r.threads.to_string(),
                format!("{}/{}", r.moved_in, r.moved_out),
            ],
            false,
        );
    }
    t
}

fn threads(model: &Model) -> Table {
    use Align::Right;
    let mut t = Table::new(vec![
        name_col("THREAD", 0, NAME_WIDTH_MAX),
        col("ID", Right, 5),
        col("REACTOR", Right, 2),
        col("BUSY%", Right, 1),
        col("CONN", Right, 3),
        col("MOVES", Right, 4),
        col("WAKE/s", Right, 6),
    ]);
    for th in &model.threads {
        t.push(
            vec![
                th.name.clone(),
                th.id.to_string(),
                th.reactor.to_string(),
                tenths(th.busy_pct),
                th.connections.to_string(),
                th.moves.to_string(),
                count(th.wakeups_per_s),
            ],
            false,
        );
    }
    t
}

fn volumes(model: &Model, view: &View) -> Table {
    use Align::{Left, Right};
    let mut t = Table::new(vec![
        name_col("VOLUME", 0, NAME_WIDTH_MAX),
        col("IOPS", Right, 1),
        col("MiB/s", Right, 2),
        col("RMiB/s", Right, 9),
        col("WMiB/s", Right, 9),
        col("P50", Right, 6),
        col("P99", Right, 3),
        col("INFL", Right, 4),
        col("CONN", Right, 5),
        col("ERR", Right, 8),
        col("QOS", Left, 10),
        col("THRms/s", Right, 11),
        col("STATE", Left, 2),
    ]);
    let shown = model.shown_volumes(view);
    for v in &shown {
        t.push(
            vec![
                v.name.clone(),
                count(v.iops),
                tenths(v.mib_s()),
                tenths(v.read_mib_s),
                tenths(v.write_mib_s),
                latency(v.p50_ns),
                latency(v.p99_ns),
                v.in_flight.to_string(),
                v.connections.to_string(),
                v.errors.to_string(),
                v.qos.clone(),
                count(v.throttled_ms_s),
                health(&v.health),
            ],
            v.health.is_alert(),
        );
    }
    if shown.is_empty() {
        t.note(if model.volumes.is_empty() {
            "(no volumes)".into()
        } else {
            format!("(no volume name contains {:?})", view.filter)
        });
    }
    if model.volumes_left_out > 0 {
        t.note(format!(
            "({} more volumes not read: top reads at most {})",
            model.volumes_left_out,
            super::sample::MAX_VOLUMES_SAMPLED
        ));
    }
    t
}

fn replicas(model: &Model, view: &View) -> Option<Table> {
    use Align::{Left, Right};
    let mut t = Table::new(vec![
        name_col("VOLUME", 0, NAME_WIDTH_MAX),
        name_col("REPLICA", 0, NAME_WIDTH_MAX),
        col("STATE", Left, 1),
        col("DONE%", Right, 2),
        col("MiB/s", Right, 3),
        col("GEN", Right, 6),
        col("INFL", Right, 5),
        col("ERR", Right, 4),
        name_col("LAST_ERROR", 7, ERROR_WIDTH_MAX),
    ]);
    for r in model.replicas.iter().filter(|r| view.keeps(&r.volume)) {
        t.push(
            vec![
                r.volume.clone(),
                r.addr.clone(),
                r.state.clone(),
                tenths(r.progress_pct),
                tenths(r.rebuild_mib_s),
                r.generation.to_string(),
                r.in_flight.to_string(),
                r.errors.to_string(),
                r.last_error.clone().unwrap_or_else(|| "-".into()),
            ],
            r.state != "healthy",
        );
    }
    (!t.rows.is_empty()).then_some(t)
}

fn store(model: &Model) -> Option<Table> {
    use Align::Right;
    let s = model.store.as_ref()?;
    let mut t = Table::new(vec![
        name_col("STORE", 0, NAME_WIDTH_MAX),
        col("CAPACITY", Right, 2),
        col("FREE", Right, 1),
        col("ALLOCATED", Right, 3),
        col("PROVISIONED", Right, 4),
        col("OVERCOMMIT%", Right, 5),
        col("REPLICAS", Right, 1),
    ]);
    t.push(
        vec![
            s.dir.clone(),
            bytes(s.capacity_bytes),
            bytes(s.free_bytes),
            bytes(s.allocated_bytes),
            bytes(s.provisioned_bytes),
            s.overcommit_percent.to_string(),
            s.replicas.len().to_string(),
        ],
        false,
    );
    Some(t)
}

fn store_replicas(model: &Model, view: &View) -> Option<Table> {
    use Align::{Left, Right};
    let s = model.store.as_ref()?;
    let mut t = Table::new(vec![
        name_col("STORE_REPLICA", 0, NAME_WIDTH_MAX),
        col("SIZE", Right, 2),
        col("ALLOC", Right, 3),
        col("GEN", Right, 5),
        col("CONN", Right, 1),
        col("CLEAN", Left, 4),
        col("INTENT", Right, 6),
        name_col("SESSION", 7, 16),
    ]);
    for r in s.replicas.iter().filter(|r| view.keeps(&r.name)) {
        t.push(
            vec![
                r.name.clone(),
                bytes(r.size_bytes),
                bytes(r.allocated_bytes),
                r.generation.to_string(),
                r.connections.to_string(),
                yes_no(r.clean),
                if r.intent_lost {
                    "lost".into()
                } else {
                    r.intent_bits_set.to_string()
                },
                r.held_by_session.clone().unwrap_or_else(|| "-".into()),
            ],
            r.intent_lost,
        );
    }
    (!t.rows.is_empty()).then_some(t)
}

/// The sections top shows, in screen order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Section {
    Reactors,
    Threads,
    Volumes,
    Replicas,
    Store,
    StoreReplicas,
}

fn sections(model: &Model, view: &View) -> Vec<(Section, Table)> {
    let mut out = vec![
        (Section::Reactors, reactors(model)),
        (Section::Threads, threads(model)),
        (Section::Volumes, volumes(model, view)),
    ];
    out.extend(replicas(model, view).map(|t| (Section::Replicas, t)));
    out.extend(store(model).map(|t| (Section::Store, t)));
    out.extend(store_replicas(model, view).map(|t| (Section::StoreReplicas, t)));
    out
}

/// The first line: what changes first, the server's path last (a long
/// one is what the width cuts).
fn title(model: Option<&Model>, view: &View, server: &str) -> String {
    let Some(m) = model else {
        return format!("lull top  waiting for the first sample  {server}");
    };
    let mut t = format!("lull top  pid {}", m.pid);
    let shown = m.volumes.iter().filter(|v| view.keeps(&v.name)).count();
    if view.filter.is_empty() {
        let n = m.volumes.len();
        t.push_str(&format!("  {n} volume{}", if n == 1 { "" } else { "s" }));
    } else {
        t.push_str(&format!(
            "  {shown} of {} volumes match {:?}",
            m.volumes.len(),
            view.filter
        ));
    }
    match m.interval {
        Some(i) => t.push_str(&format!("  rates over {:.2}s", i.as_secs_f64())),
        None => t.push_str("  rates after the next sample"),
    }
    t.push_str(&format!("  {server}"));
    t
}

fn sort_name(view: &View) -> String {
    let descending = (view.sort != SortKey::Name) != view.reversed;
    format!(
        "{} {}",
        view.sort.as_str(),
        if descending { "desc" } else { "asc" }
    )
}

fn help(view: &View) -> String {
    if view.editing.is_some() {
        return format!(
            "filter: {}_   Enter keep  Esc cancel  Ctrl-C quit",
            view.filter
        );
    }
    let mut h = format!("q quit  s sort ({})  r reverse  / filter", sort_name(view));
    if !view.filter.is_empty() {
        h.push_str("  Esc clear filter");
    }
    h
}

/// `--once`: every section with every row and column, a blank line
/// between sections, no escape codes.
pub(crate) fn snapshot(model: &Model, view: &View, server: &str) -> String {
    let mut out = title(Some(model), view, server);
    out.push('\n');
    for (_, table) in sections(model, view) {
        out.push('\n');
        for line in table.lines(None) {
            out.push_str(&line.text);
            out.push('\n');
        }
    }
    out
}

/// The interactive view in `width` × `height`: a title line, the
/// sections, and the help line at the bottom.
pub(crate) fn screen(
    model: Option<&Model>,
    view: &View,
    server: &str,
    width: usize,
    height: usize,
) -> Vec<ScreenLine> {
    let help = ScreenLine::new(help(view), Tone::Help);
    if height <= 1 {
        return vec![clip(help, width)].into_iter().take(height).collect();
    }
    let mut lines = vec![ScreenLine::new(title(model, view, server), Tone::Title)];
    if let Some(model) = model {
        let tables = sections(model, view);
        let (heights, gaps) = allocate(&tables, height - 2);
        for ((_, table), rows) in tables.iter().zip(heights) {
            if rows == 0 {
                continue;
            }
            if gaps && lines.len() > 1 {
                lines.push(ScreenLine::new(String::new(), Tone::Body));
            }
            let mut all = table.lines(Some(width));
            if all.len() > rows {
                // The header, what fits, and how many rows did not: on a
                // line of its own, or beside the header when only one row
                // fits.
                let fitting = if rows == 2 { 1 } else { rows - 2 };
                let more = format!("+{} more", table.rows.len() - fitting);
                all.truncate(1 + fitting);
                if rows == 2 {
                    if chars(&all[0].text) + 2 + chars(&more) <= width {
                        all[0].text = format!("{}  {more}", all[0].text);
                    }
                } else {
                    all.push(ScreenLine::new(more, Tone::Dim));
                }
            }
            lines.extend(all);
        }
    }
    lines.truncate(height - 1);
    while lines.len() < height - 1 {
        lines.push(ScreenLine::new(String::new(), Tone::Body));
    }
    lines.push(help);
    lines.into_iter().map(|l| clip(l, width)).collect()
}

/// Lines per section within `body` lines, and whether blank lines
/// between sections fit too (they do when they leave every section that
/// would be shown without them its header and a row).
fn allocate(tables: &[(Section, Table)], body: usize) -> (Vec<usize>, bool) {
    let alloc = grant(tables, body);
    let shown = alloc.iter().filter(|a| **a > 0).count();
    let least: usize = tables
        .iter()
        .zip(&alloc)
        .filter(|(_, a)| **a > 0)
        .map(|((_, t), _)| least(t))
        .sum();
    let blanks = shown.saturating_sub(1);
    if blanks > 0 && least + blanks <= body {
        let spaced = grant(tables, body - blanks);
        // Blanks that would push a section off the screen are not worth it.
        if spaced.iter().filter(|a| **a > 0).count() == shown {
            return (spaced, true);
        }
    }
    (alloc, false)
}

/// A section's smallest showing: its header and one row.
fn least(t: &Table) -> usize {
    1 + t.rows.len().min(1)
}

/// Hands out `body` lines in rounds, most needed first: the volumes'
/// header and a row, the reactors', half the body to the volumes, the
/// replicas and threads, a quarter each to reactors, replicas and threads,
/// the store's; then whatever is left, volumes first. A section never
/// gets its header without a row; one that does not get that much is
/// not shown.
fn grant(tables: &[(Section, Table)], body: usize) -> Vec<usize> {
    use Section::{Reactors, Replicas, Store, StoreReplicas, Threads, Volumes};
    let (least_of, half, quarter, all) = (0, body / 2, body / 4, usize::MAX);
    let rounds = [
        (Volumes, least_of),
        (Reactors, least_of),
        (Volumes, half),
        (Replicas, least_of),
        (Threads, least_of),
        (Reactors, quarter),
        (Replicas, quarter),
        (Threads, quarter),
        (Store, least_of),
        (StoreReplicas, least_of),
        (Volumes, all),
        (Store, all),
        (StoreReplicas, all),
        (Replicas, all),
        (Threads, all),
        (Reactors, all),
    ];
    let mut alloc = vec![0; tables.len()];
    let mut left = body;
    for (section, target) in rounds {
        let Some(i) = tables.iter().position(|(s, _)| *s == section) else {
            continue;
        };
        let table = &tables[i].1;
        let goal = (1 + table.rows.len()).min(target.max(least(table)));
        let more = goal.saturating_sub(alloc[i]);
        if alloc[i] == 0 && more > left {
            continue; // not even its header and a row
        }
        let more = more.min(left);
        alloc[i] += more;
        left -= more;
    }
    alloc
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::time::Instant;

    use super::super::model::tests::sample;
    use super::super::model::{Model, Top};
    use super::*;

    fn model(volumes: &[(&str, u64, u64)]) -> Model {
        let t0 = Instant::now();
        let zero: Vec<(&str, u64, u64)> = volumes.iter().map(|(n, _, _)| (*n, 0, 0)).collect();
        let a = sample(t0, 0, 0, 0, &zero);
        let b = sample(t0, 1, 250_000_000, 0, volumes);
        Model::between(Some(&a), &b, &HashMap::new())
    }

    fn texts(lines: &[ScreenLine]) -> Vec<&str> {
        lines.iter().map(|l| l.text.as_str()).collect()
    }

    #[test]
    fn formats() {
        assert_eq!(latency(0), "-");
        assert_eq!(latency(512), "512ns");
        assert_eq!(latency(65_536), "66us");
        assert_eq!(latency(2_500_000), "2.5ms");
        assert_eq!(latency(3_000_000_000), "3.00s");
        assert_eq!(bytes(512), "512");
        assert_eq!(bytes(64 << 20), "64.0M");
        assert_eq!(bytes(3 << 39), "1.5T");
        assert_eq!(fit("abcdef", 4, Align::Left), "abc~");
        assert_eq!(fit("ab", 4, Align::Right), "  ab");
    }

    #[test]
    fn snapshot_names_everything_with_rates() {
        let m = model(&[("idle", 0, 0), ("busy", 5000, 20 << 20)]);
        let text = snapshot(&m, &View::default(), "/tmp/s.sock");
        assert!(!text.contains('\x1b'));
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "lull top  pid 42  2 volumes  rates over 1.00s  /tmp/s.sock"
        );
        let header = lines.iter().find(|l| l.starts_with("VOLUME")).unwrap();
        let iops_at = header.split_whitespace().position(|c| c == "IOPS").unwrap();
        let iops = |name: &str| -> String {
            let row = lines.iter().find(|l| l.starts_with(name)).unwrap();
            row.split_whitespace().nth(iops_at).unwrap().to_string()
        };
        assert_eq!(iops("busy"), "5000");
        assert_eq!(iops("idle"), "0");
        let busy_row = lines.iter().position(|l| l.starts_with("busy")).unwrap();
        let idle_row = lines.iter().position(|l| l.starts_with("idle")).unwrap();
        assert!(busy_row < idle_row, "sorted by IOPS, busiest first");
        assert!(text.contains("\nREACTOR "));
        assert!(text.contains("\n0          3 adaptive"), "{text}");
        assert!(text.contains("\nnbd-group-0 "));
    }

    #[test]
    fn fits_80_by_24_dropping_columns_not_wrapping() {
        let vols: Vec<(String, u64, u64)> = (0..40)
            .map(|i| {
                (
                    format!("a-rather-long-volume-name-{i:02}"),
                    i * 1000,
                    i << 20,
                )
            })
            .collect();
        let refs: Vec<(&str, u64, u64)> =
            vols.iter().map(|(n, r, b)| (n.as_str(), *r, *b)).collect();
        let m = model(&refs);
        for (w, h) in [(80, 24), (40, 10), (200, 60), (10, 3), (80, 1)] {
            let lines = screen(Some(&m), &View::default(), "/var/tmp/lull.sock", w, h);
            assert_eq!(lines.len(), h, "{w}x{h}");
            for l in &lines {
                assert!(chars(&l.text) <= w, "{w}x{h}: {:?}", l.text);
            }
            assert_eq!(lines.last().unwrap().tone, Tone::Help);
        }
        let lines = screen(Some(&m), &View::default(), "/var/tmp/lull.sock", 80, 24);
        let t = texts(&lines);
        assert!(t.iter().any(|l| l.starts_with("REACTOR")), "{t:#?}");
        let header = |lines: &[ScreenLine]| {
            let l = lines.iter().find(|l| l.text.starts_with("VOLUME")).unwrap();
            l.text
                .split_whitespace()
                .map(String::from)
                .collect::<Vec<_>>()
        };
        assert_eq!(header(&lines).len(), 11, "all fit in 80 columns");
        let narrow = screen(Some(&m), &View::default(), "/var/tmp/lull.sock", 60, 24);
        assert_eq!(
            header(&narrow),
            ["VOLUME", "IOPS", "MiB/s", "P99", "INFL", "CONN", "STATE"],
            "the least needed columns go first"
        );
        assert!(t.iter().any(|l| l.starts_with("+") && l.ends_with("more")));
        // The busiest volume is on screen; names are cut, not wrapped.
        assert!(t.iter().any(|l| l.starts_with("a-rather-long-volume-na~")));
        assert!(t.last().unwrap().starts_with("q quit  s sort (iops desc)"));
    }

    #[test]
    fn small_server_on_80_by_24() {
        let m = model(&[("a", 10, 4096), ("b", 0, 0), ("c", 30, 0)]);
        let lines = screen(Some(&m), &View::default(), "/var/tmp/lull.sock", 80, 24);
        let t = texts(&lines);
        let at = |p: &str| t.iter().position(|l| l.starts_with(p)).unwrap();
        assert!(at("c ") < at("a ") && at("a ") < at("b "), "{t:#?}");
        assert!(at("REACTOR") < at("THREAD") && at("THREAD") < at("VOLUME"));
        // Every column fits: nothing is dropped.
        assert!(t[at("VOLUME")].ends_with("STATE"), "{t:#?}");
        assert!(t[at("b ")].ends_with("malloc"));
    }

    /// A storage node: a replicated volume (one replica rebuilding, 40
    /// MiB done in the second), a local one, many threads, a store.
    fn node_model() -> Model {
        use super::super::sample::{Progress, Replica, Store, StoreReplica, Thread};
        let t0 = Instant::now();
        let at = |secs: u64, done_mib: u64| {
            let mut s = sample(t0, secs, 0, 0, &[("local", 0, 0), ("rv", 0, 0)]);
            s.volumes[1].backend = "replicas=10.0.0.1:1+10.0.0.2:1".into();
            let replica = |addr: &str, state: &str, rebuild| Replica {
                addr: addr.into(),
                state: state.into(),
                rebuild,
                ..Replica::default()
            };
            let progress = Progress {
                done_bytes: done_mib << 20,
                total_bytes: 400 << 20,
            };
            s.volumes[1].replicas = Some(vec![
                replica("10.0.0.1:1", "healthy", None),
                replica("10.0.0.2:1", "rebuilding", Some(progress)),
            ]);
            s.threads.extend((2..8).map(|id| Thread {
                id,
                name: format!("t{id}"),
                ..Thread::default()
            }));
            s.store = Some(Store {
                dir: "/srv/lull".into(),
                replicas: vec![StoreReplica {
                    name: "pvc-1".into(),
                    ..StoreReplica::default()
                }],
                ..Store::default()
            });
            s
        };
        Model::between(Some(&at(0, 100)), &at(1, 140), &HashMap::new())
    }

    #[test]
    fn a_storage_node_shows_replicas_and_its_store() {
        let m = node_model();
        let text = snapshot(&m, &View::default(), "/s");
        let rows: Vec<&str> = text.lines().collect();
        let row = |p: &str| *rows.iter().find(|l| l.starts_with(p)).unwrap();
        assert!(row("rv ").ends_with("rebuild:35%"), "{text}");
        let rebuilding = rows.iter().find(|l| l.contains("10.0.0.2:1")).unwrap();
        let words: Vec<&str> = rebuilding.split_whitespace().collect();
        assert_eq!(
            words[..5],
            ["rv", "10.0.0.2:1", "rebuilding", "35.0", "40.0"]
        );
        assert!(row("STORE ").contains("OVERCOMMIT%"));
        assert!(row("pvc-1 ").ends_with(" -"));
        // On small screens every line is used, each section shown has a
        // row, and the volumes come first.
        for h in 5..30 {
            let lines = screen(Some(&m), &View::default(), "/s", 80, h);
            let t = texts(&lines);
            assert_eq!(t.len(), h);
            let body = &t[1..h - 1];
            let headers = ["REACTOR", "THREAD", "VOLUME", "STORE"];
            for (n, l) in body.iter().enumerate() {
                if headers.iter().any(|hd| l.starts_with(hd)) {
                    let next = body.get(n + 1).copied().unwrap_or("");
                    assert!(!next.is_empty(), "{h}: a header alone:\n{}", t.join("\n"));
                }
            }
            assert!(body.iter().any(|l| l.starts_with("VOLUME")), "{h}");
            if h < 20 {
                assert!(!body.last().unwrap().is_empty(), "{h}:\n{}", t.join("\n"));
            }
        }
    }

    #[test]
    fn waiting_and_editing() {
        let top = Top::new("/s".into(), View::default());
        let lines = screen(top.model.as_ref(), &top.view, &top.server, 80, 24);
        assert_eq!(lines[0].text, "lull top  waiting for the first sample  /s");
        let view = View {
            editing: Some(String::new()),
            filter: "vo".into(),
            ..View::default()
        };
        let m = model(&[("vol1", 1, 1), ("x", 2, 2)]);
        let lines = screen(Some(&m), &view, "/s", 80, 24);
        assert!(lines[23].text.starts_with("filter: vo_"));
        assert!(lines[0]
            .text
            .starts_with("lull top  pid 42  1 of 2 volumes match \"vo\"  rates over"));
        let t = texts(&lines);
        assert!(t.iter().any(|l| l.starts_with("vol1")));
        assert!(!t.iter().any(|l| l.starts_with("x ")));
        let none = View {
            filter: "zzz".into(),
            ..View::default()
        };
        let lines = screen(Some(&m), &none, "/s", 80, 24);
        assert!(texts(&lines).contains(&"(no volume name contains \"zzz\")"));
    }
}
