//! The interactive view on a terminal: three threads feed one channel
//! (samples every period, keys, stop signals), the loop applies each input
//! to [`Top`] and draws with ratatui when the view changed. ratatui
//! compares each frame with the last and writes only the cells that
//! changed, so the screen does not flicker.
//!
//! The terminal is put back (raw mode off, the main screen back) before
//! any line is printed, and by ratatui's panic hook if a panic happens.

use std::io::{self, IsTerminal};
use std::process::ExitCode;
use std::sync::mpsc::{self, Sender};
use std::thread;
use std::time::{Duration, Instant};

use crossterm::event::{self, Event, KeyCode, KeyEvent, KeyEventKind, KeyModifiers};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::Paragraph;
use ratatui::DefaultTerminal;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

use super::model::{Action, Exit, Input, Key, Top, View};
use super::render::{screen, Tone};
use super::sample::{Sampler, Source};
use crate::cli::EXIT_USAGE;

/// Runs the view until `q`, Ctrl-C, a stop signal, or the server going
/// away; gives the exit code.
pub(crate) fn run(source: Source, period: Duration, view: View) -> ExitCode {
    if !io::stdout().is_terminal() {
        eprintln!("lull top: error: stdout is not a terminal; --once prints a plain-text snapshot");
        return ExitCode::from(EXIT_USAGE);
    }
    let (tx, rx) = mpsc::channel();
    // Raw mode turns Ctrl-C into a key; these come from `kill` or from
    // the terminal closing (SIGHUP), and must restore the terminal too.
    let mut signals = match Signals::new([SIGINT, SIGTERM, SIGHUP]) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("lull top: error: cannot install signal handlers: {e}");
            return ExitCode::FAILURE;
        }
    };
    let to_loop = tx.clone();
    thread::spawn(move || {
        if signals.forever().next().is_some() {
            let _ = to_loop.send(Input::Signal);
        }
    });
    let mut top = Top::new(source.name(), view);
    spawn_sampler(source, period, tx.clone());
    let mut terminal = match ratatui::try_init() {
        Ok(t) => t,
        Err(e) => {
            ratatui::restore();
            eprintln!("lull top: error: cannot set up the terminal: {e}");
            return ExitCode::FAILURE;
        }
    };
    spawn_keys(tx);
    let exit = view_loop(&mut terminal, &mut top, &rx);
    // Errors here mean the terminal is gone (SIGHUP): nothing to restore
    // and nowhere to say so.
    if terminal.show_cursor().is_err() {
        // Its drop would try again and print the error.
        std::mem::forget(terminal);
    }
    let _ = ratatui::try_restore();
    match exit {
        Exit::Asked => ExitCode::SUCCESS,
        Exit::Failed(line) => {
            eprintln!("{line}");
            ExitCode::FAILURE
        }
    }
}

fn view_loop(terminal: &mut DefaultTerminal, top: &mut Top, rx: &mpsc::Receiver<Input>) -> Exit {
    loop {
        if let Err(e) = draw(terminal, top) {
            return Exit::Failed(format!("lull top: the terminal went away: {e}"));
        }
        loop {
            // Every sender lives as long as its thread, and the signal
            // thread as long as the process: recv fails only if they died.
            let Ok(input) = rx.recv() else {
                return Exit::Failed("lull top: its input threads stopped".into());
            };
            match top.apply(input) {
                Action::Nothing => {}
                Action::Redraw => break,
                Action::Quit(exit) => return exit,
            }
        }
    }
}

/// Samples every `period` (from the start of one to the start of the
/// next) until one fails or the view has gone.
fn spawn_sampler(source: Source, period: Duration, tx: Sender<Input>) {
    thread::spawn(move || {
        let mut sampler = Sampler::new(source);
        loop {
            let started = Instant::now();
            let result = sampler.sample(started);
            let failed = result.is_err();
            if tx.send(Input::Sample(result)).is_err() || failed {
                return;
            }
            thread::sleep((started + period).saturating_duration_since(Instant::now()));
        }
    });
}

fn spawn_keys(tx: Sender<Input>) {
    thread::spawn(move || loop {
        let input = match event::read() {
            Ok(Event::Key(k)) if k.kind != KeyEventKind::Release => match key(k) {
                Some(k) => Input::Key(k),
                None => continue,
            },
            Ok(Event::Resize(..)) => Input::Resize,
            Ok(_) => continue,
            Err(e) => {
                let _ = tx.send(Input::TerminalLost(e.to_string()));
                return;
            }
        };
        if tx.send(input).is_err() {
            return;
        }
    });
}

fn key(k: KeyEvent) -> Option<Key> {
    match k.code {
        KeyCode::Char('c') if k.modifiers.contains(KeyModifiers::CONTROL) => Some(Key::Interrupt),
        KeyCode::Char(c) => Some(Key::Char(c)),
        KeyCode::Enter => Some(Key::Enter),
        KeyCode::Esc => Some(Key::Esc),
        KeyCode::Backspace => Some(Key::Backspace),
        _ => None,
    }
}

fn style(tone: Tone) -> Style {
    match tone {
        Tone::Title => Style::new().add_modifier(Modifier::BOLD),
        Tone::Header => Style::new().add_modifier(Modifier::REVERSED),
        Tone::Body => Style::new(),
        Tone::Alert => Style::new().fg(Color::Yellow).add_modifier(Modifier::BOLD),
        Tone::Dim => Style::new().add_modifier(Modifier::DIM),
        Tone::Help => Style::new().add_modifier(Modifier::REVERSED),
    }
}

fn draw(terminal: &mut DefaultTerminal, top: &Top) -> io::Result<()> {
    terminal.draw(|frame| {
        let area = frame.area();
        let lines: Vec<Line> = screen(
            top.model.as_ref(),
            &top.view,
            &top.server,
            usize::from(area.width),
            usize::from(area.height),
        )
        .into_iter()
        .map(|l| Line::styled(l.text, style(l.tone)))
        .collect();
        frame.render_widget(Paragraph::new(lines), area);
    })?;
    Ok(())
}
