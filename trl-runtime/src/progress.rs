//! Training progress from rank 0 to the launcher.
//!
//! Workers' output is piped through the launcher, so a progress bar drawn by a worker never
//! reaches a terminal. Instead, when the launcher sets [`LINES_VAR`], rank 0's trainer writes
//! one [`Event`] per line on stderr (`TRL_PROGRESS {json}`), and the launcher shows them with a
//! [`View`]: one live bar on a terminal (log lines print above it), or a plain progress line every
//! few seconds elsewhere (CI, SLURM logs). This module knows neither trainers nor launchers.

use serde::{Deserialize, Serialize};
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// Set by the launcher for its workers: write progress events instead of drawing a bar.
pub const LINES_VAR: &str = "TRL_PROGRESS_LINES";
/// Seconds between plain progress lines when the launcher's stderr is not a terminal
/// (default 5; 0 prints every step).
pub const SECONDS_VAR: &str = "TRL_PROGRESS_SECONDS";
const PREFIX: &str = "TRL_PROGRESS ";

/// What rank 0 tells the launcher.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// An optimizer step finished.
    Step {
        step: u64,
        total: u64,
        // A non-finite value travels as JSON's null (serde_json writes NaN so) and reads
        // back as NaN.
        #[serde(deserialize_with = "f64_or_nan")]
        loss: f64,
        #[serde(deserialize_with = "f64_or_nan")]
        lr: f64,
        #[serde(deserialize_with = "f64_or_nan")]
        tokens_per_s: f64,
    },
    /// A checkpoint was written (renamed into place).
    Saved { path: String },
}

fn f64_or_nan<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

impl Event {
    /// The line a worker writes.
    pub fn line(&self) -> String {
        format!(
            "{PREFIX}{}",
            serde_json::to_string(self).expect("events serialize")
        )
    }

    /// The event in a line of worker output, if it is one.
    pub fn parse(line: &str) -> Option<Event> {
        serde_json::from_str(line.strip_prefix(PREFIX)?).ok()
    }
}

/// Whether this process should write events (the launcher asked for them).
pub fn lines_requested() -> bool {
    std::env::var_os(LINES_VAR).is_some_and(|v| v == "1")
}

/// Writes one event line on stderr (one write, so lines of other threads do not interleave).
pub fn emit(event: &Event) {
    let _ = writeln!(std::io::stderr().lock(), "{}", event.line());
}

/// The launcher's side: prints worker lines and shows progress without tearing either.
pub struct View {
    bar: Option<indicatif::ProgressBar>,
    plain_every: Duration,
    last_plain: Option<Instant>,
    /// The first step seen and when (for the plain line's rate and ETA).
    first: Option<(u64, Instant)>,
    /// The last checkpoint rank 0 reported.
    pub last_checkpoint: Option<String>,
}

impl View {
    /// A bar on a terminal, plain lines every `plain_every` otherwise.
    pub fn new(interactive: bool, plain_every: Duration) -> View {
        View {
            // Hidden until rank 0's first step (the launcher builds the program first).
            bar: interactive.then(|| styled(indicatif::ProgressBar::hidden())),
            plain_every,
            last_plain: None,
            first: None,
            last_checkpoint: None,
        }
    }

    /// As the launcher's stderr and the environment say.
    pub fn for_this_terminal() -> View {
        let every = std::env::var(SECONDS_VAR)
            .ok()
            .and_then(|s| s.trim().parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s >= 0.0)
            .unwrap_or(5.0);
        View::new(
            std::io::stderr().is_terminal(),
            Duration::from_secs_f64(every),
        )
    }

    /// Prints one line of worker output (above the bar, if one is drawn).
    pub fn println(&self, line: &str, to_stderr: bool) {
        let print = || {
            if to_stderr {
                let _ = writeln!(std::io::stderr().lock(), "{line}");
            } else {
                let _ = writeln!(std::io::stdout().lock(), "{line}");
            }
        };
        match &self.bar {
            Some(bar) => bar.suspend(print),
            None => print(),
        }
    }

    pub fn update(&mut self, event: Event) {
        match &event {
            Event::Saved { path } => self.last_checkpoint = Some(path.clone()),
            Event::Step {
                step,
                total,
                loss,
                lr,
                tokens_per_s,
            } => {
                let first = *self.first.get_or_insert((*step, Instant::now()));
                if let Some(bar) = &self.bar {
                    if bar.is_hidden() {
                        bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
                        bar.reset_eta();
                    }
                    bar.set_length(*total);
                    bar.set_position(*step);
                    bar.set_message(format!(
                        "loss {loss:.4} lr {lr:.2e} {tokens_per_s:.0} tok/s"
                    ));
                } else {
                    let due = self
                        .last_plain
                        .is_none_or(|t| t.elapsed() >= self.plain_every);
                    if due || step == total {
                        self.last_plain = Some(Instant::now());
                        let line = plain_line(&event, first);
                        let _ = writeln!(std::io::stderr().lock(), "{line}");
                    }
                }
            }
        }
    }

    /// Removes the bar (the last state stays printed).
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.abandon();
        }
    }
}

/// The one look of a training progress bar (the trainer's own, and the launcher's).
pub fn styled(bar: indicatif::ProgressBar) -> indicatif::ProgressBar {
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
        )
        .expect("valid template"),
    );
    bar
}

/// `progress: step 40/100 (40%) loss 2.1234 lr 1.00e-04 1234 tok/s elapsed 0:12 eta 0:18`
fn plain_line(event: &Event, (first_step, since): (u64, Instant)) -> String {
    let Event::Step {
        step,
        total,
        loss,
        lr,
        tokens_per_s,
    } = event
    else {
        return String::new();
    };
    let elapsed = since.elapsed().as_secs_f64();
    let done = step.saturating_sub(first_step);
    let eta = if done > 0 {
        clock(elapsed / done as f64 * total.saturating_sub(*step) as f64)
    } else {
        "?".into()
    };
    format!(
        "progress: step {step}/{total} ({:.0}%) loss {loss:.4} lr {lr:.2e} {tokens_per_s:.0} tok/s elapsed {} eta {eta}",
        100.0 * *step as f64 / (*total).max(1) as f64,
        clock(elapsed)
    )
}

/// h:mm:ss, or m:ss under an hour.
fn clock(seconds: f64) -> String {
    let s = seconds.max(0.0).round() as u64;
    match s / 3600 {
        0 => format!("{}:{:02}", s / 60, s % 60),
        h => format!("{h}:{:02}:{:02}", s / 60 % 60, s % 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_round_trip_through_their_line() {
        let step = Event::Step {
            step: 3,
            total: 10,
            loss: 1.5,
            lr: 1e-4,
            tokens_per_s: 1000.0,
        };
        assert_eq!(Event::parse(&step.line()), Some(step));
        let saved = Event::Saved {
            path: "out/checkpoint-3".into(),
        };
        assert_eq!(Event::parse(&saved.line()), Some(saved));
        // A NaN loss (written as null) still reads as a step.
        let nan = Event::Step {
            step: 4,
            total: 10,
            loss: f64::NAN,
            lr: 1e-4,
            tokens_per_s: 1000.0,
        };
        match Event::parse(&nan.line()) {
            Some(Event::Step { step: 4, loss, .. }) => assert!(loss.is_nan()),
            other => panic!("{other:?} from {}", nan.line()),
        }
        assert_eq!(Event::parse("[INFO] step 3"), None);
        assert_eq!(Event::parse("TRL_PROGRESS {not json"), None);
    }

    #[test]
    fn plain_line_says_where_the_job_is_and_when_it_ends() {
        let e = Event::Step {
            step: 40,
            total: 100,
            loss: 2.12345,
            lr: 1e-4,
            tokens_per_s: 1234.4,
        };
        let line = plain_line(&e, (40, Instant::now()));
        assert!(
            line.starts_with("progress: step 40/100 (40%) loss 2.1235 lr 1.00e-4 1234 tok/s"),
            "{line}"
        );
        assert!(line.ends_with("eta ?"), "{line}");
        assert_eq!(clock(3725.0), "1:02:05");
        assert_eq!(clock(65.0), "1:05");
    }
}
