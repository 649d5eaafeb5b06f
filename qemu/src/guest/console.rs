//! A guest's serial console: the reader threads, its lines with times, and the
//! markers read from it.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{ChildStderr, ChildStdout};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use super::{verbose, DONE_MARKER, ERROR_TAIL_LINES, RESULT_MARKER};

/// A console line with the host's time of arrival
/// ([`Guest::timed_console`](super::Guest::timed_console)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TimedLine {
    /// When the host read its end.
    pub at: Instant,
    /// The line, without its end.
    pub text: String,
}

/// A guest's console with times ([`Guest::timed_console`](super::Guest::timed_console)).
#[derive(Debug, Clone, Default)]
pub struct TimedConsole {
    /// Complete lines, in order.
    pub lines: Vec<TimedLine>,
    /// Text after the last newline (empty if none).
    pub unterminated: String,
}

/// One line of console output.
#[derive(Debug, Clone)]
pub(super) struct Line {
    /// Since QEMU was started.
    pub(super) at: Duration,
    pub(super) text: String,
}

#[derive(Debug, Default)]
pub(super) struct ConsoleState {
    pub(super) lines: Vec<Line>,
    /// Output after the last newline.
    pub(super) partial: String,
    /// QEMU closed its stdout (it exited).
    pub(super) eof: bool,
    /// The last of `lines` was not ended by a newline (QEMU exited after it).
    pub(super) eof_unterminated: bool,
    pub(super) qemu_stderr: Vec<String>,
}

#[derive(Debug, Default)]
pub(super) struct Console {
    pub(super) state: Mutex<ConsoleState>,
    pub(super) changed: Condvar,
}

impl Console {
    pub(super) fn lock(&self) -> MutexGuard<'_, ConsoleState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// `(rc, when)` of the first `DEVLEND-DONE rc=N` line.
pub(super) fn find_done(lines: &[Line]) -> Option<(i32, Duration)> {
    lines.iter().find_map(|line| {
        let rest = &line.text[line.text.find(DONE_MARKER)? + DONE_MARKER.len()..];
        let digits: String = rest
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == '-')
            .collect();
        digits.parse().ok().map(|rc| (rc, line.at))
    })
}

/// `key=value` of a `DEVLEND-RESULT key=value` line (the marker may follow
/// other output on the same line).
pub(super) fn parse_result(line: &str) -> Option<(&str, &str)> {
    let rest = &line[line.find(RESULT_MARKER)? + RESULT_MARKER.len()..];
    let (key, value) = rest.split_once('=')?;
    let key = key.trim();
    if key.is_empty() || key.contains(char::is_whitespace) {
        return None;
    }
    Some((key, value.trim_end()))
}

pub(super) fn tail<'a>(lines: impl DoubleEndedIterator<Item = &'a str>, count: usize) -> String {
    let mut last: Vec<&str> = lines.rev().take(count).collect();
    last.reverse();
    last.join("\n")
}

pub(super) fn describe(state: &ConsoleState) -> String {
    let mut text = format!("--- console (last {ERROR_TAIL_LINES} lines) ---\n");
    text.push_str(&tail(
        state.lines.iter().map(|l| l.text.as_str()),
        ERROR_TAIL_LINES,
    ));
    if !state.partial.is_empty() {
        text.push('\n');
        text.push_str(&state.partial);
    }
    if !state.qemu_stderr.is_empty() {
        text.push_str("\n--- QEMU stderr ---\n");
        text.push_str(&tail(
            state.qemu_stderr.iter().map(String::as_str),
            ERROR_TAIL_LINES,
        ));
    }
    text
}

/// Where the console reader is in a terminal escape sequence.
#[derive(Clone, Copy)]
enum Escape {
    None,
    /// After ESC.
    Start,
    /// After ESC [, until a final byte.
    Csi,
}

pub(super) fn spawn_console_reader(
    mut stdout: ChildStdout,
    console: Arc<Console>,
    name: String,
    started: Instant,
) -> Result<JoinHandle<()>> {
    let echo = verbose();
    std::thread::Builder::new()
        .name(format!("{name}-console"))
        .spawn(move || {
            let mut buf = [0u8; 4096];
            let mut escape = Escape::None;
            loop {
                let n = match stdout.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                let chunk = String::from_utf8_lossy(&buf[..n]);
                let mut state = console.lock();
                for c in chunk.chars() {
                    // Drop terminal escape sequences (the firmware clears
                    // the screen): ESC [ ... final byte, or ESC + one char.
                    match escape {
                        Escape::None if c == '\x1b' => {
                            escape = Escape::Start;
                            continue;
                        }
                        Escape::None => {}
                        Escape::Start => {
                            escape = if c == '[' { Escape::Csi } else { Escape::None };
                            continue;
                        }
                        Escape::Csi => {
                            if ('\x40'..='\x7e').contains(&c) {
                                escape = Escape::None;
                            }
                            continue;
                        }
                    }
                    match c {
                        '\n' => {
                            let text = std::mem::take(&mut state.partial);
                            if echo {
                                let _ = writeln!(std::io::stderr(), "[{name}] {text}");
                            }
                            state.lines.push(Line {
                                at: started.elapsed(),
                                text,
                            });
                        }
                        '\r' => {}
                        c => state.partial.push(c),
                    }
                }
                drop(state);
                console.changed.notify_all();
            }
            let mut state = console.lock();
            if !state.partial.is_empty() {
                let text = std::mem::take(&mut state.partial);
                state.lines.push(Line {
                    at: started.elapsed(),
                    text,
                });
                state.eof_unterminated = true;
            }
            state.eof = true;
            drop(state);
            console.changed.notify_all();
        })
        .context("spawning the console reader thread")
}

pub(super) fn spawn_stderr_reader(
    stderr: ChildStderr,
    console: Arc<Console>,
    name: String,
) -> Result<JoinHandle<()>> {
    let echo = verbose();
    std::thread::Builder::new()
        .name(format!("{name}-stderr"))
        .spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if echo {
                    let _ = writeln!(std::io::stderr(), "[{name} qemu] {line}");
                }
                console.lock().qemu_stderr.push(line);
            }
        })
        .context("spawning the QEMU stderr reader thread")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_results_and_done() {
        assert_eq!(
            parse_result("DEVLEND-RESULT kernel=6.1.0-57-amd64\r"),
            Some(("kernel", "6.1.0-57-amd64"))
        );
        assert_eq!(
            parse_result("noise DEVLEND-RESULT a=b=c"),
            Some(("a", "b=c"))
        );
        assert_eq!(parse_result("DEVLEND-RESULT novalue"), None);
        let lines = vec![
            Line {
                at: Duration::from_secs(1),
                text: "x".into(),
            },
            Line {
                at: Duration::from_secs(2),
                text: "DEVLEND-DONE rc=3".into(),
            },
        ];
        assert_eq!(find_done(&lines), Some((3, Duration::from_secs(2))));
    }
}
